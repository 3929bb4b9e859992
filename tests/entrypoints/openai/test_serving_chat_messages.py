"""Tool turns in the shapes clients send, made renderable (serving_chat_messages.py)."""

from __future__ import annotations

from typing import Any

import pytest

from kvserve.entrypoints.openai.serving_chat_messages import messages_for_template

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
CALL = {
    "id": "c1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
OPENAI_LOOP: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "18C"}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]
ANTHROPIC_LOOP: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather?"},
    {
        "role": "assistant",
        "content": [
            {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Paris"}}
        ],
    },
    {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "c1",
                "content": [{"type": "text", "text": "18C"}],
            },
            {"type": "tool_result", "tool_use_id": "c1", "content": "sunny"},
        ],
    },
]


@pytest.mark.parametrize("messages", [OPENAI_LOOP, ANTHROPIC_LOOP], ids=["openai", "anthropic"])
def test_a_template_with_tools_gets_the_openai_shape(messages: list[dict[str, Any]]) -> None:
    out, tools = messages_for_template(messages, TOOLS, template_has_tools=True)
    assert tools == TOOLS
    assistant = out[2]
    assert assistant["content"] == ""
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert [(m["role"], m["content"], m["name"]) for m in out[3:]] == [
        ("tool", "18C", "get_weather"),
        ("tool", "sunny", "get_weather"),
    ]


@pytest.mark.parametrize("messages", [OPENAI_LOOP, ANTHROPIC_LOOP], ids=["openai", "anthropic"])
def test_a_template_without_tools_gets_hermes_text(messages: list[dict[str, Any]]) -> None:
    out, tools = messages_for_template(messages, TOOLS, template_has_tools=False)
    assert tools is None
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\nYou may call one or more functions")
    assert '"name": "get_weather"' in out[0]["content"]
    assert out[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>",
    }
    assert out[3]["content"] == (
        "<tool_response>\n18C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"
    )


def test_plain_chats_pass_through() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert messages_for_template(messages, None, template_has_tools=False) == (messages, None)


@pytest.mark.parametrize(
    "messages",
    [
        [{"content": "no role"}],
        [{"role": "assistant", "content": None, "tool_calls": {"id": "c1"}}],
        [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": 1}}]}],
        [{"role": "tool", "tool_call_id": "c1", "content": [{"type": "image_url"}]}],
    ],
    ids=["no-role", "calls-not-a-list", "nameless-call", "image-result"],
)
def test_malformed_tool_turns_are_value_errors(messages: list[dict[str, Any]]) -> None:
    # render_prompt answers them with a 400 on messages.
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        messages_for_template(messages, TOOLS, template_has_tools=False)
