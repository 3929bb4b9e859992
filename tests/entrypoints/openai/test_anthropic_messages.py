"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) against a real
`kvserve serve`, driven by the official anthropic client.

On the shared server: its chatml template has no tool support, so tool turns render in the
chat path's hermes fallback form and the model's own calls (forced tokens) are read by the
hermes parser. A second server runs a reasoning parser, for thinking blocks.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from tests.entrypoints.openai.utils import RemoteServer
from tests.forced_tokens import forced_xargs

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TOOLS: list[Any] = [
    {"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER},
    {
        "name": "get_time",
        "description": "Current time in a timezone",
        "input_schema": {"type": "object", "properties": {"timezone": {"type": "string"}}},
    },
]
SYSTEM = "You are a concise assistant."
ASK: list[Any] = [{"role": "user", "content": "What is the weather like in Paris today?"}]
# A 1x1 PNG.
PNG = base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c6360f8cfc000000301010018dd8db40000000049454e44ae426082"
    )
).decode()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(server: RemoteServer) -> str:
    return server.client().models.list().data[0].id


# This client version has no temperature argument (the server takes the field): greedy.
GREEDY = {"temperature": 0}


def create(client: anthropic.Anthropic, model: str, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", ASK)
    kwargs.setdefault("max_tokens", 24)
    kwargs["extra_body"] = {**GREEDY, **kwargs.get("extra_body", {})}
    return client.messages.create(model=model, **kwargs)


def text_of(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_reply_is_the_chat_endpoints_greedy_reply(
    client: anthropic.Anthropic, server: RemoteServer, model: str
) -> None:
    message = create(client, model, system=SYSTEM)
    chat = server.client().chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": SYSTEM}, *ASK],
        max_tokens=24,
        temperature=0,
    )
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == model
    assert text_of(message) == chat.choices[0].message.content
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens
    expected = {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert message.stop_reason == expected and message.stop_sequence is None


def test_stream_accumulates_to_the_same_message(client: anthropic.Anthropic, model: str) -> None:
    full = create(client, model, system=[{"type": "text", "text": SYSTEM}])
    kinds: list[str] = []
    with client.messages.stream(
        model=model, max_tokens=24, system=SYSTEM, messages=ASK, extra_body=GREEDY
    ) as stream:
        for event in stream:
            kinds.append(event.type)
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop"} <= set(kinds)
    assert text_of(streamed) == text_of(full)
    assert streamed.stop_reason == full.stop_reason
    assert streamed.usage.input_tokens == full.usage.input_tokens
    assert streamed.usage.output_tokens == full.usage.output_tokens


def test_stop_sequence_and_max_tokens(client: anthropic.Anthropic, model: str) -> None:
    text = text_of(create(client, model))
    stop = text.split()[2]
    stopped = create(client, model, stop_sequences=[stop])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert text_of(stopped) == text[: text.index(stop)]
    short = create(client, model, max_tokens=3)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


@pytest.mark.parametrize(
    "tool_choice",
    [{"type": "tool", "name": "get_weather"}, {"type": "any", "disable_parallel_tool_use": True}],
)
def test_forced_tool_use(client: anthropic.Anthropic, model: str, tool_choice: Any) -> None:
    message = create(client, model, tools=TOOLS, tool_choice=tool_choice, max_tokens=60)
    assert message.stop_reason == "tool_use"
    [call] = [b for b in message.content if b.type == "tool_use"]
    assert call.id.startswith("toolu_")
    schema = next(t["input_schema"] for t in TOOLS if t["name"] == call.name)
    jsonschema.validate(call.input, schema)
    if tool_choice["type"] == "tool":
        assert call.name == "get_weather"


def test_streamed_tool_use_input_json_deltas(client: anthropic.Anthropic, model: str) -> None:
    choice = {"type": "tool", "name": "get_weather"}
    full = create(client, model, tools=TOOLS, tool_choice=choice, max_tokens=60)
    partial: list[str] = []
    with client.messages.stream(
        model=model,
        max_tokens=60,
        messages=ASK,
        tools=TOOLS,
        tool_choice=choice,
        extra_body=GREEDY,
    ) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partial.append(event.delta.partial_json)
        streamed = stream.get_final_message()
    [call] = full.content
    assert len(partial) > 1, "the arguments should stream as they are generated"
    assert json.loads("".join(partial)) == call.input
    [streamed_call] = streamed.content
    assert streamed_call.type == "tool_use" and streamed_call.name == "get_weather"
    assert streamed_call.input == call.input and streamed.stop_reason == "tool_use"


def test_count_tokens_is_the_prompts_length(client: anthropic.Anthropic, model: str) -> None:
    conversation: Any = [
        *ASK,
        {"role": "assistant", "content": [{"type": "text", "text": "Sunny, 21 degrees."}]},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
    ]
    system: Any = [{"type": "text", "text": SYSTEM}, {"type": "text", "text": "Be brief."}]
    counted = client.messages.count_tokens(model=model, system=system, messages=conversation)
    message = create(client, model, system=system, messages=conversation, max_tokens=1)
    assert counted.input_tokens == message.usage.input_tokens > 20


def test_bad_requests_get_anthropics_error_shape(
    client: anthropic.Anthropic, server: RemoteServer, model: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        create(client, model, messages=[{"role": "user", "content": 5}])
    assert bad.value.status_code == 400
    body: Any = bad.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "messages" in body["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    with pytest.raises(anthropic.BadRequestError, match="text-only"):
        create(client, model, messages=[{"role": "user", "content": [image]}])
    with pytest.raises(anthropic.NotFoundError) as missing:
        create(client, model="no-such-model")
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    # Fields the server does not serve are ignored, as Anthropic does; the server still serves.
    message = create(client, model, max_tokens=2, extra_body={"thinking": {"type": "disabled"}})
    assert message.usage.output_tokens == 2
    assert httpx.get(server.url("/health")).status_code == 200


def test_tool_result_round_trip(client: anthropic.Anthropic, model: str, tokenizer: Any) -> None:
    choice = {"type": "tool", "name": "get_weather"}
    first = create(client, model, tools=TOOLS, tool_choice=choice, max_tokens=60)
    [call] = first.content
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "18 C, clear sky"}
    conversation: Any = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [result]},
    ]
    # The answer is forced: the tiny model's own would be a matter of luck.
    answer = "It is 18 C and clear in Paris."
    ids = [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]
    body = {"vllm_xargs": forced_xargs(ids)}
    second = create(client, model, messages=conversation, tools=TOOLS, extra_body=body)
    assert (text_of(second), second.stop_reason) == (answer, "end_turn")
    assert second.usage.input_tokens > first.usage.input_tokens
    counted = client.messages.count_tokens(model=model, messages=conversation, tools=TOOLS)
    assert counted.input_tokens == second.usage.input_tokens


def test_default_tool_choice_parses_the_models_call(
    client: anthropic.Anthropic, model: str, tokenizer: Any
) -> None:
    """No tool_choice is Anthropic's auto: the model's own text and call (hermes) become a
    text block and a tool_use block, whole and streamed."""
    text = 'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "CET"}}\n</tool_call>'
    ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
    body = {"vllm_xargs": forced_xargs(ids)}
    message = create(client, model, tools=TOOLS, max_tokens=60, extra_body=body)
    with client.messages.stream(
        model=model, max_tokens=60, messages=ASK, tools=TOOLS, extra_body=body
    ) as stream:
        streamed = stream.get_final_message()
    for reply in (message, streamed):
        assert reply.stop_reason == "tool_use"
        assert [b.type for b in reply.content] == ["text", "tool_use"]
        assert text_of(reply).strip() == "Let me check."
        call = reply.content[1]
        assert (call.name, call.input) == ("get_time", {"timezone": "CET"})


@pytest.fixture(scope="module")
def thinking_server() -> Iterator[RemoteServer]:
    remote = RemoteServer("--reasoning-parser", "qwen3", forced_tokens=True)
    yield remote
    remote.stop()


def test_reasoning_is_a_thinking_block(
    thinking_server: RemoteServer, model: str, tokenizer: Any
) -> None:
    """A thinking model's reasoning (forced here) is a thinking block before the text."""
    client = anthropic.Anthropic(base_url=thinking_server.base_url, api_key="-", max_retries=0)
    output = "<think>\nThe user asks about the weather.\n</think>\n\nIt is sunny."
    ids = [*tokenizer.encode(output, add_special_tokens=False), tokenizer.eos_token_id]
    body = {"vllm_xargs": forced_xargs(ids)}
    message = create(client, model, max_tokens=60, extra_body=body)
    deltas: list[str] = []
    with client.messages.stream(
        model=model, max_tokens=60, messages=ASK, extra_body=body
    ) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                deltas.append(event.delta.type)
        streamed = stream.get_final_message()
    assert {"thinking_delta", "text_delta"} <= set(deltas)
    for reply in (message, streamed):
        assert [b.type for b in reply.content] == ["thinking", "text"]
        assert reply.content[0].thinking.strip() == "The user asks about the weather."
        assert text_of(reply).strip() == "It is sunny."
        assert reply.stop_reason == "end_turn"
