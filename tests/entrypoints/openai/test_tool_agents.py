"""Agents' tool loops against a default `kvserve serve` (no tool flags) on the default
model and its own chat template, which has no tool support: the server renders tools,
calls and results in hermes' form and reads the model's calls with the hermes parser.

The tiny model is made to answer as a tool-calling model would (tests/forced_tokens.py):
a <tool_call> on the first turn, a sentence once the prompt holds the tool's result. The
clients are the real ones (openai SDK, LangChain, pydantic-ai), each sending back what it
received: ``content: None`` beside ``tool_calls`` with JSON-text arguments, then the
``role: "tool"`` result.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.entrypoints.openai.utils import RemoteServer
from tests.forced_tokens import forced_xargs

pytestmark = pytest.mark.slow

CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is 18 degrees and sunny in Paris."
WEATHER = "18 degrees, sunny"
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def agent_xargs(tokenizer: Any) -> dict[str, str]:
    """Forces the call until the prompt holds a tool result (the fallback's
    <tool_response> tag), the answer after."""
    eos = tokenizer.eos_token_id
    return forced_xargs(
        [*tokenizer.encode(CALL_TEXT), eos],
        then=[*tokenizer.encode(ANSWER), eos],
        after=tokenizer.encode("<tool_response>"),
    )


@pytest.fixture(scope="module")
def model(server: RemoteServer) -> str:
    return server.client().models.list().data[0].id


def get_weather(city: str) -> str:
    """The current weather in a city."""
    assert city == "Paris"
    return WEATHER


def ask(
    client: openai.OpenAI, model: str, messages: list[Any], xargs: dict[str, str], stream: bool
) -> Any:
    """One turn; streamed, the SDK's own accumulation (chat.completions.stream) builds it."""
    kwargs: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "tools": TOOLS,
        "tool_choice": "auto",
        "max_tokens": 64,
        "extra_body": {"vllm_xargs": xargs},
    }
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0]
    with client.chat.completions.stream(**kwargs) as events:
        return events.get_final_completion().choices[0]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_sdk_agent_loop(
    server: RemoteServer, model: str, agent_xargs: dict[str, str], stream: bool
) -> None:
    client = server.client()
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = ask(client, model, messages, agent_xargs, stream)
    assert first.finish_reason == "tool_calls"
    [call] = first.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    # Whole: None; streamed: the role chunk's "" (as OpenAI's stream starts).
    assert first.message.content is None if not stream else not first.message.content
    messages.append(first.message)  # as agents do: the SDK's object as it came
    result = get_weather(**json.loads(call.function.arguments))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    final = ask(client, model, messages, agent_xargs, stream)
    assert final.finish_reason == "stop" and not final.message.tool_calls
    assert final.message.content == ANSWER


def test_langchain_agent_loop(server: RemoteServer, model: str, agent_xargs: Any) -> None:
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    weather = tool(get_weather)
    llm = ChatOpenAI(
        model=model,
        base_url=server.url("/v1"),
        api_key="EMPTY",  # type: ignore[arg-type]
        max_retries=0,
        extra_body={"vllm_xargs": agent_xargs},
    ).bind_tools([weather], tool_choice="auto")
    messages: list[Any] = [HumanMessage("What is the weather in Paris?")]
    ai = llm.invoke(messages)
    assert [(c["name"], c["args"]) for c in ai.tool_calls] == [("get_weather", {"city": "Paris"})]
    messages += [ai, weather.invoke(ai.tool_calls[0])]
    final = llm.invoke(messages)
    assert final.content == ANSWER and not final.tool_calls


def test_pydantic_ai_agent_loop(server: RemoteServer, model: str, agent_xargs: Any) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(openai_client=server.async_client())
    agent = Agent(
        OpenAIChatModel(model, provider=provider),
        model_settings={"extra_body": {"vllm_xargs": agent_xargs}, "max_tokens": 64},
        tools=[get_weather],
    )
    result = agent.run_sync("What is the weather in Paris?")
    assert result.output == ANSWER
    calls = [
        part
        for message in result.all_messages()
        for part in message.parts
        if part.part_kind == "tool-call"
    ]
    assert [(c.tool_name, c.args_as_dict()) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_a_malformed_tool_turn_is_a_400(server: RemoteServer, model: str) -> None:
    messages: list[Any] = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "function": {}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "x"},
    ]
    with pytest.raises(openai.BadRequestError, match=r"function\.name") as err:
        server.client().chat.completions.create(model=model, messages=messages, tools=TOOLS)
    assert err.value.body["param"] == "messages"  # type: ignore[index]
