"""Tool call parsers: complete outputs and the shared streaming, no model needed."""

from __future__ import annotations

import json

import pytest

from kvserve.entrypoints.openai.tool_parsers import ToolCallStreamer, ToolParserManager

HERMES_OUT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)
LLAMA_OUT = (
    '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_time", "parameters": {"tz": "CET"}}'
)
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]


@pytest.mark.parametrize(("name", "text"), [("hermes", HERMES_OUT), ("llama3_json", LLAMA_OUT)])
def test_extracts_every_call(name: str, text: str) -> None:
    info = ToolParserManager.get_tool_parser(name)(None).extract_tool_calls(text)
    assert info.tools_called
    got = [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls]
    assert got == CALLS
    assert len({c.id for c in info.tool_calls}) == 2
    assert info.content == ("Let me check." if name == "hermes" else None)


@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
@pytest.mark.parametrize("text", ["Just words.", "<tool_call>{not json</tool_call>", "{broken"])
def test_text_without_a_valid_call_is_content(name: str, text: str) -> None:
    info = ToolParserManager.get_tool_parser(name)(None).extract_tool_calls(text)
    assert not info.tools_called and info.content == text


@pytest.mark.parametrize(("name", "text"), [("hermes", HERMES_OUT), ("llama3_json", LLAMA_OUT)])
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_pieces_reassemble_into_the_same_calls(name: str, text: str, step: int) -> None:
    streamer = ToolCallStreamer(ToolParserManager.get_tool_parser(name)(None))
    content, calls = "", {}
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate(pieces):
        delta, deltas = streamer.feed(piece, finished=i == len(pieces) - 1)
        content += delta
        for d in deltas:
            entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
            assert d.id is not None
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == CALLS
    # No tag or JSON fragment leaks into the streamed content.
    assert content.strip() == ("Let me check." if name == "hermes" else "")


def test_streamed_plain_text_is_all_content() -> None:
    streamer = ToolCallStreamer(ToolParserManager.get_tool_parser("hermes")(None))
    text = "A <tool or two, but no call."
    out = "".join(streamer.feed(ch, finished=i == len(text) - 1)[0] for i, ch in enumerate(text))
    assert out == text and not streamer.tools_called


def test_unknown_parser() -> None:
    with pytest.raises(ValueError, match="hermes"):
        ToolParserManager.get_tool_parser("nope")
