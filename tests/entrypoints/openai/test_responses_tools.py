"""Function tools on /v1/responses (the openai SDK, whole and streamed, and an openai-agents
agent end to end), and --metrics-prefix vllm.

Named and "required" tool_choice are grammar-enforced: they run on the shared server. A
tool output round trip needs a template that renders tool messages, and "auto" needs a tool
call parser: those run on the package's tool server, with the hermes template and parser
(it also exports vLLM's metric names).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.openai.utils import RemoteServer
from tests.forced_tokens import forced_xargs

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the weather in Paris?"
WEATHER: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
TIME: dict[str, Any] = {
    "type": "function",
    "name": "get_time",
    "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
}
NAMED = {"type": "function", "name": "get_weather"}


def create(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs = {"model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 48} | kwargs
    return client.responses.create(**kwargs)


def test_named_and_required_tool_choice_return_function_calls(server: RemoteServer) -> None:
    client = server.client()
    named = create(client, tools=[WEATHER, TIME], tool_choice=NAMED)
    assert named.status == "completed" and named.tool_choice.name == "get_weather"
    [call] = named.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id and call.status == "completed"
    assert isinstance(json.loads(call.arguments)["city"], str)
    required = create(
        client, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False
    )
    [call] = required.output
    assert call.type == "function_call" and call.name in ("get_weather", "get_time")
    assert required.parallel_tool_calls is False
    # Without a parser on this server, tools alone leave the model to answer in text.
    none = create(client, tools=[WEATHER], tool_choice="none", max_output_tokens=8)
    assert [item.type for item in none.output] == ["message"] and none.output_text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "x"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"input": [{"type": "function_call_output", "output": "1"}]}, "input"),
    ],
)
def test_bad_tools_are_400s(server: RemoteServer, body: dict[str, Any], param: str) -> None:
    response = httpx.post(
        server.url("/v1/responses"), json={"model": MODEL, "input": QUESTION, **body}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_streamed_function_call_events_rebuild_the_whole_response(server: RemoteServer) -> None:
    client = server.client()
    whole = create(client, tools=[WEATHER], tool_choice=NAMED)
    events = list(create(client, tools=[WEATHER], tool_choice=NAMED, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added = events[2].item
    assert added.type == "function_call" and added.name == "get_weather"
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert deltas and {e.item_id for e in deltas} == {added.id}
    arguments = "".join(e.delta for e in deltas)
    [call] = events[-1].response.output
    assert call.id == added.id and call.call_id == added.call_id
    assert arguments == events[-3].arguments == call.arguments == whole.output[0].arguments


def test_tool_output_round_trip_answers_like_chat(tool_server: RemoteServer) -> None:
    client = tool_server.client()
    first = create(client, tools=[WEATHER], tool_choice="required")
    [call] = first.output
    assert call.type == "function_call"
    turn = [
        {"role": "user", "content": QUESTION},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"},
    ]
    second = create(client, input=turn, tools=[WEATHER], tool_choice="none")
    assert [item.type for item in second.output] == ["message"] and second.output_text
    # The same conversation in chat form renders to the same prompt, so the same answer.
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": QUESTION},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 24 C"},
        ],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        tool_choice="none",
        temperature=0,
        max_tokens=48,
    )
    assert second.output_text == chat.choices[0].message.content
    assert second.usage is not None and chat.usage is not None
    assert second.usage.input_tokens == chat.usage.prompt_tokens


def test_auto_tool_choice_reads_the_models_calls(tool_server: RemoteServer, tokenizer: Any) -> None:
    text = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    forced = forced_xargs(
        [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
    )
    client = tool_server.client()
    kwargs = {"tools": [WEATHER], "extra_body": {"vllm_xargs": forced}, "max_output_tokens": 64}
    whole = create(client, **kwargs)
    message, call = whole.output
    assert message.type == "message" and whole.output_text == "Let me check."
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    events = list(create(client, stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text_deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(text_deltas) == "Let me check."
    streamed = events[-1].response
    assert events[-1].type == "response.completed"
    assert [item.type for item in streamed.output] == ["message", "function_call"]
    assert json.loads(streamed.output[1].arguments) == {"city": "Paris"}


def test_openai_agents_agent_calls_a_tool(tool_server: RemoteServer) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"Sunny, 24 C in {city}"

    agent = Agent(
        name="weather",
        instructions="Answer with the weather the tool reports.",
        model=OpenAIResponsesModel(model=MODEL, openai_client=tool_server.async_client()),
        # The answer ends at its first sentence: the turn completes, whatever the model says.
        model_settings=ModelSettings(
            tool_choice="get_weather",
            temperature=0,
            max_tokens=48,
            extra_body={"stop": [".", "\n"]},
        ),
        tools=[get_weather],
    )

    async def run_whole_then_streamed() -> tuple[Any, Any, list[str]]:
        # One event loop: the agent's client belongs to it.
        result = await Runner.run(agent, QUESTION, max_turns=3)
        run = Runner.run_streamed(agent, QUESTION, max_turns=3)
        events = [event.type async for event in run.stream_events()]
        return result, run, events

    result, streamed, events = asyncio.run(run_whole_then_streamed())
    assert len(calls) == 2 and len(set(calls)) == 1  # greedy: the same call both times
    assert isinstance(result.final_output, str) and result.final_output
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    assert "raw_response_event" in events and "run_item_stream_event" in events
    assert streamed.final_output == result.final_output


def test_metrics_prefix_vllm_gives_vllms_names(
    tool_server: RemoteServer, server: RemoteServer
) -> None:
    create(tool_server.client(), max_output_tokens=2)  # counted, whatever ran before
    families = {
        f.name: f
        for f in text_string_to_metric_families(httpx.get(tool_server.url("/metrics")).text)
    }
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:request_success",
        "vllm:time_to_first_token_seconds",
        "vllm:time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds",
    ):
        assert name in families, name
        assert all(s.labels.get("model_name") == MODEL for s in families[name].samples), name
    assert not [name for name in families if name.startswith("kvserve:")]
    values = tool_server.metrics()
    assert values["vllm:prompt_tokens_total"] > 0 and values["vllm:generation_tokens_total"] > 0
    create(server.client(), max_output_tokens=2)
    default = server.metrics()
    assert "kvserve:num_requests_running" in default and "kvserve:prompt_tokens_total" in default
    assert not [name for name in default if name.startswith("vllm:")]
