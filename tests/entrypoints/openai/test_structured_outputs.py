"""response_format, vLLM's structured output extras and tool calling against a real
`kvserve serve`, driven by the official openai client."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pydantic
import pytest

from tests.entrypoints.openai.utils import RemoteServer

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
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a timezone",
            "parameters": {
                "type": "object",
                "properties": {"timezone": {"type": "string", "maxLength": 20}},
                "required": ["timezone"],
            },
        },
    },
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK: list[Any] = [{"role": "user", "content": "What is the weather like in Paris today?"}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.fixture(scope="module")
def client(tool_server: RemoteServer) -> openai.OpenAI:
    # The package's tool server: the hermes template and tool call parser.
    return openai.OpenAI(base_url=tool_server.url("/v1"), api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def chat(client: openai.OpenAI, model: str, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", ASK)
    kwargs.setdefault("max_tokens", 120)
    return client.chat.completions.create(model=model, temperature=0, **kwargs)


def check_call(call: Any) -> None:
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_parse_with_a_pydantic_model(client: openai.OpenAI, model: str) -> None:
    completion = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Describe a person called Bob, aged 40, as JSON."}],
        response_format=Person,
        temperature=0,
        max_tokens=100,
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, Person)
    assert completion.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_object"}},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "w", "schema": WEATHER},
            }
        },
        {"extra_body": {"guided_json": WEATHER}},
        {"extra_body": {"structured_outputs": {"json": WEATHER}}},
    ],
)
def test_json_constraints(client: openai.OpenAI, model: str, extra: dict[str, Any]) -> None:
    text = chat(client, model, **extra).choices[0].message.content
    value = json.loads(text)
    if extra.get("response_format", {}).get("type") != "json_object":
        jsonschema.validate(value, WEATHER)


def test_regex_choice_and_grammar_on_completions(client: openai.OpenAI, model: str) -> None:
    def complete(**extra: Any) -> str:
        response = client.completions.create(
            model=model, prompt="Answer:", max_tokens=20, temperature=0, extra_body=extra
        )
        return response.choices[0].text

    assert complete(guided_regex=r"[0-9]{2}:[0-9]{2}")[2] == ":"
    assert complete(guided_choice=["alpha", "beta"]) in ("alpha", "beta")
    assert complete(guided_grammar='root ::= "on" | "off"') in ("on", "off")


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        ({"guided_regex": "(unclosed"}, "regex"),
        ({"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "json"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "exactly one"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
    ],
)
def test_invalid_constraint_is_a_400_and_the_server_keeps_serving(
    client: openai.OpenAI, model: str, extra: dict[str, Any], problem: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, model, extra_body=extra, max_tokens=5)
    error = info.value.body
    assert isinstance(error, dict) and error["type"] == "BadRequestError"
    assert problem in error["message"]
    assert chat(client, model, max_tokens=3).choices[0].message.content


def test_required_tool_choice_always_calls(client: openai.OpenAI, model: str) -> None:
    prompts = ["Weather in Paris?", "What time is it in Tokyo?", "Tell me a joke."]
    for text in prompts:
        response = chat(
            client, model, messages=[{"role": "user", "content": text}], tools=TOOLS,
            tool_choice="required",
        )  # fmt: skip
        choice = response.choices[0]
        # "length": the model went on adding calls; every complete one is returned.
        assert choice.message.tool_calls and choice.finish_reason in ("tool_calls", "length")
        for call in choice.message.tool_calls:
            check_call(call)


def test_named_tool_choice_calls_that_function(client: openai.OpenAI, model: str) -> None:
    for name in PARAMETERS:
        named = {"type": "function", "function": {"name": name}}
        response = chat(client, model, tools=TOOLS, tool_choice=named)
        [call] = response.choices[0].message.tool_calls
        assert call.function.name == name
        check_call(call)
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        chat(
            client, model, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}}
        )


def test_auto_returns_content_or_a_call(client: openai.OpenAI, model: str) -> None:
    response = chat(client, model, tools=TOOLS, tool_choice="auto")
    message = response.choices[0].message
    assert message.content or message.tool_calls
    for call in message.tool_calls or []:
        assert call.function.name in PARAMETERS
        json.loads(call.function.arguments)
    none = chat(client, model, tools=TOOLS, tool_choice="none").choices[0].message
    assert none.content and not none.tool_calls


def reassemble(stream: Any) -> tuple[str, list[tuple[str, dict[str, Any]]], list[str]]:
    content, calls, ids, finish = "", {}, [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            if tc.id:
                ids.append(tc.id)
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    parsed = [(c["name"], json.loads(c["arguments"])) for c in calls.values()]
    return content, parsed, [*ids, str(finish)]


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_streamed_tool_calls_reassemble_into_the_same_call(
    client: openai.OpenAI, model: str, tool_choice: Any
) -> None:
    full = chat(client, model, tools=TOOLS, tool_choice=tool_choice)
    expected = [
        (c.function.name, json.loads(c.function.arguments))
        for c in full.choices[0].message.tool_calls
    ]
    stream = chat(client, model, tools=TOOLS, tool_choice=tool_choice, stream=True)
    content, calls, ids = reassemble(stream)
    assert calls == expected and not content
    assert len(ids) == len(calls) + 1 and ids[-1] == full.choices[0].finish_reason


def test_second_turn_with_the_tool_result(client: openai.OpenAI, model: str) -> None:
    first = chat(client, model, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    [call] = first.choices[0].message.tool_calls
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "clear"}'},
    ]
    second = chat(client, model, messages=messages, tools=TOOLS, tool_choice="none")
    assert second.choices[0].message.content
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
