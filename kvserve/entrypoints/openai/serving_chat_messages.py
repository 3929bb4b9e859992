"""Chat messages as clients send them -> messages every chat template can render.

Agent loops send back what they received: an assistant turn with ``content: null`` and
``tool_calls`` whose arguments are JSON text (openai SDK, LangChain, pydantic-ai), then
``role: "tool"`` results; the Anthropic SDK's shape is content blocks (``tool_use`` in the
assistant turn, ``tool_result`` in the next user turn). Templates expect the OpenAI shape
with string content and arguments as objects.

A template that does not read ``tools`` (SmolLM2's chatml renders ``message['content']``
only) gets the tools, the calls and the results written out in hermes' conventions: a
system section listing the tools and asking for ``<tool_call>{"name", "arguments"}
</tool_call>``, each call as that text in the assistant turn, results as
``<tool_response>`` text in a user turn. The hermes parser reads the model's calls back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

Message = dict[str, Any]

TOOLS_SYSTEM_PROMPT = (
    "You may call one or more functions to assist with the user query. The function "
    "signatures are within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def messages_for_template(
    messages: list[Message], tools: list[dict[str, Any]] | None, template_has_tools: bool
) -> tuple[list[Message], list[dict[str, Any]] | None]:
    """(messages, tools) to give the template; raises ValueError on a malformed tool turn."""
    out = _openai_shape(messages)
    uses_tools = bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in out)
    if template_has_tools or not uses_tools:
        return out, tools
    return _hermes_fallback(out, tools), None


def _openai_shape(messages: list[Message]) -> list[Message]:
    out: list[Message] = []
    names: dict[str, str] = {}  # tool_call_id -> function name, for tool results
    for i, msg in _expand_anthropic_blocks(messages):
        if not isinstance(msg, Mapping) or not isinstance(msg.get("role"), str):
            raise ValueError(f"messages[{i}] must be a dict with a 'role' string")
        role = msg["role"]
        if role == "assistant" and msg.get("tool_calls"):
            calls = msg["tool_calls"]
            if not isinstance(calls, list):
                raise ValueError(f"messages[{i}].tool_calls must be a list")
            calls = [_call(c, i) for c in calls]
            names.update(
                (c["id"], c["function"]["name"]) for c in calls if isinstance(c.get("id"), str)
            )
            msg = {**msg, "content": msg.get("content") or "", "tool_calls": calls}
        elif role == "tool":
            msg = {**msg, "content": _text(msg.get("content"), i)}
            call_id = msg.get("tool_call_id")
            if not msg.get("name") and isinstance(call_id, str) and call_id in names:
                msg["name"] = names[call_id]  # some templates label results by function
        out.append(dict(msg))
    return out


def _expand_anthropic_blocks(messages: list[Message]) -> list[tuple[int, Any]]:
    """(index in the request, message), with Anthropic's tool blocks as OpenAI messages."""
    out: list[tuple[int, Any]] = []
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, Mapping) else None
        role = msg.get("role") if isinstance(msg, Mapping) else None
        blocks = None
        if isinstance(content, list) and role in ("assistant", "user"):
            blocks = _anthropic_blocks(content, role, i)
        if blocks is None:
            out.append((i, msg))
        else:
            out.extend((i, m) for m in blocks)
    return out


def _call(call: Any, i: int) -> dict[str, Any]:
    """A call with its arguments as an object, as templates render them (``| tojson``)."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"messages[{i}].tool_calls: each call needs function.name")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass  # the model wrote invalid JSON: the template shows it as it was
    return {**call, "type": "function", "function": {**function, "arguments": arguments}}


def _text(content: Any, i: int) -> str:
    """Text content: a string, text parts, or nothing."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise ValueError(f"messages[{i}] has a non-text part where text is expected")
        return "\n".join(texts)
    raise ValueError(f"messages[{i}].content must be a string or a list of text parts")


def _anthropic_blocks(content: list[Any], role: str, i: int) -> list[Message] | None:
    """Anthropic's tool_use / tool_result blocks as OpenAI messages (None: there are none)."""
    kinds = {b.get("type") for b in content if isinstance(b, Mapping)}
    if not kinds & {"tool_use", "tool_result"}:
        return None
    if role == "assistant":
        calls = [
            {
                "id": b.get("id"),
                "type": "function",
                "function": {"name": b.get("name"), "arguments": b.get("input") or {}},
            }
            for b in content
            if isinstance(b, Mapping) and b.get("type") == "tool_use"
        ]
        text = [b for b in content if not (isinstance(b, Mapping) and b.get("type") == "tool_use")]
        return [{"role": "assistant", "content": _text(text, i), "tool_calls": calls}]
    # A user turn: its tool results first (they answer the previous turn), then its text.
    out: list[Message] = []
    rest: list[Any] = []
    for block in content:
        if isinstance(block, Mapping) and block.get("type") == "tool_result":
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": block.get("tool_use_id"),
                    "content": _text(block.get("content"), i),
                }
            )
        else:
            rest.append(block)
    if rest:
        out.append({"role": "user", "content": rest})
    return out


def _hermes_fallback(messages: list[Message], tools: list[dict[str, Any]] | None) -> list[Message]:
    out: list[Message] = []
    if tools:
        section = TOOLS_SYSTEM_PROMPT.format(
            tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        )
        if messages and messages[0]["role"] == "system":
            first = _text(messages[0].get("content"), 0)
            out.append({**messages[0], "content": f"{first}\n\n{section}" if first else section})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": section})
    previous = ""
    for i, msg in enumerate(messages):
        if msg["role"] == "tool":
            result = f"<tool_response>\n{msg['content']}\n</tool_response>"
            if previous == "tool":  # consecutive results share one user turn
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + result}
            else:
                out.append({"role": "user", "content": result})
        elif msg["role"] == "assistant" and msg.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in msg["tool_calls"])
            text = _text(msg["content"], i)
            out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        else:
            out.append(msg)
        previous = msg["role"]
    return out


def _call_text(call: dict[str, Any]) -> str:
    function = call["function"]
    body = json.dumps(
        {"name": function["name"], "arguments": function["arguments"]}, ensure_ascii=False
    )
    return f"<tool_call>\n{body}\n</tool_call>"
