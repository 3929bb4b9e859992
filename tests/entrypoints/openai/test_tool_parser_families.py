"""The tool call parsers of each model family on real token streams: a model's output
tokenized with the default model's tokenizer and fed back one token's text at a time, as
the server streams it. The SDK's accumulation of the deltas must rebuild the calls the
whole output parses into."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvserve.entrypoints.openai.tool_parsers import ToolCallStreamer, ToolParserManager

CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
# (parser, a model's output with CALLS, the content beside them)
OUTPUTS = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
        "Let me check.",
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {"tz": "CET"}}',
        None,
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"tz": "CET"}}]',
        None,
    ),
    (
        "mistral",
        'Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
        '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"tz": "CET"}',
        "Checking.",
    ),
    ("pythonic", '[get_weather(city="Paris"), get_time(tz="CET")]', None),
    (
        "pythonic",
        '<|python_start|>[get_weather(city="Paris"), get_time(tz="CET")]<|python_end|>',
        None,
    ),
    (
        "qwen3_coder",
        "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
        "<parameter=tz>\nCET\n</parameter>\n</function>\n</tool_call>",
        "Let me check.",
    ),
    (
        "granite",
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"tz": "CET"}}]',
        None,
    ),
]
IDS = [f"{name}-{i}" for i, (name, _, _) in enumerate(OUTPUTS)]


def token_texts(tokenizer: Any, text: str) -> list[str]:
    """Each token's text as the incremental detokenizer emits it."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    texts = [tokenizer.decode(ids[:n]) for n in range(len(ids) + 1)]
    assert texts[-1] == text
    return [texts[n][len(texts[n - 1]) :] for n in range(1, len(texts))]


def accumulate(deltas: list[Any]) -> dict[int, dict[str, str]]:
    """What the openai SDK's stream accumulation does with tool call deltas."""
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        entry = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
        entry["id"] += d.id or ""
        entry["name"] += d.function.name or ""
        entry["arguments"] += d.function.arguments or ""
    return calls


@pytest.mark.parametrize(("name", "text", "content"), OUTPUTS, ids=IDS)
def test_whole_output(name: str, text: str, content: str | None) -> None:
    info = ToolParserManager.get_tool_parser(name)(None).extract_tool_calls(text)
    assert info.tools_called and info.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == CALLS


@pytest.mark.parametrize(("name", "text", "content"), OUTPUTS, ids=IDS)
def test_token_stream_rebuilds_the_calls(
    tokenizer: Any, name: str, text: str, content: str | None
) -> None:
    parser = ToolParserManager.get_tool_parser(name)(None)
    streamer = ToolCallStreamer(parser)
    pieces = token_texts(tokenizer, text)
    streamed, deltas = "", []
    for i, piece in enumerate(pieces):
        delta, calls = streamer.feed(piece, finished=i == len(pieces) - 1)
        streamed += delta
        deltas += calls
    rebuilt = accumulate(deltas)
    assert streamer.tools_called and list(rebuilt) == [0, 1]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in rebuilt.values())
    assert [(c["name"], json.loads(c["arguments"])) for c in rebuilt.values()] == CALLS
    # The same calls as the whole output, and no markup leaks into the content.
    whole = parser.extract_tool_calls(text)
    assert [(c.function.name, c.function.arguments) for c in whole.tool_calls] == [
        (c["name"], c["arguments"]) for c in rebuilt.values()
    ]
    assert streamed.strip() == (content or "")


@pytest.mark.parametrize("name", sorted({n for n, _, _ in OUTPUTS}))
@pytest.mark.parametrize(
    "text", ["Just words.", "[1] is a citation", "<tool_call>{not json", "[TOOL_CALLS]{oops"]
)
def test_text_without_a_valid_call_is_content(tokenizer: Any, name: str, text: str) -> None:
    parser = ToolParserManager.get_tool_parser(name)(None)
    info = parser.extract_tool_calls(text)
    assert not info.tools_called and info.content == text
    streamer = ToolCallStreamer(parser)
    pieces = token_texts(tokenizer, text)
    out = "".join(streamer.feed(p, finished=i == len(pieces) - 1)[0] for i, p in enumerate(pieces))
    assert out == text and not streamer.tools_called


def test_pythonic_reads_literals_only() -> None:
    parser = ToolParserManager.get_tool_parser("pythonic")(None)
    info = parser.extract_tool_calls('[f(n=3, on=true, tags=["a", "b"], opts={"x": None})]')
    [call] = info.tool_calls
    assert json.loads(call.function.arguments) == {
        "n": 3,
        "on": True,
        "tags": ["a", "b"],
        "opts": {"x": None},
    }
    # A name that is no literal is not evaluated: the output stays content.
    assert not parser.extract_tool_calls("[f(x=__import__('os'))]").tools_called


def test_qwen3_coder_values_keep_their_json_types() -> None:
    parser = ToolParserManager.get_tool_parser("qwen3_coder")(None)
    text = (
        "<tool_call>\n<function=set_timer>\n<parameter=minutes>\n5\n</parameter>\n"
        "<parameter=label>\ntea time\n</parameter>\n<parameter=opts>\n"
        '{"loud": true}\n</parameter>\n</function>\n</tool_call>'
    )
    [call] = parser.extract_tool_calls(text).tool_calls
    assert call.function.name == "set_timer"
    args = json.loads(call.function.arguments)
    assert args == {"minutes": 5, "label": "tea time", "opts": {"loud": True}}
