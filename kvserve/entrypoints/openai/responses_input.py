"""A Responses API input as OpenAI chat messages, so the chat path renders it.

Messages (text, or input_text / output_text parts) map one to one. A ``function_call`` item
(what the model called, sent back by the client) joins the assistant message before it as a
``tool_calls`` entry, or opens one with ``content: None``; a ``function_call_output`` item
becomes a ``role: tool`` message with its ``tool_call_id``.
"""

from __future__ import annotations

from typing import Any

from kvserve.entrypoints.openai.protocol import OpenAIServingError

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def input_messages(items: str | list[Any]) -> list[dict[str, Any]]:
    """The chat messages of a request's ``input`` (or of a stored response's output)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise OpenAIServingError(f"input[{i}] must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "function_call":
            _add_call(messages, item, i)
        elif kind == "function_call_output":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", i),
                    "content": _text(item.get("output"), i, "output"),
                }
            )
        elif kind == "message" and item.get("role") in _ROLES:
            role = _ROLES[str(item["role"])]
            messages.append({"role": role, "content": _text(item.get("content"), i, "content")})
        else:
            raise OpenAIServingError(
                f"input[{i}]: only messages with role user, assistant, system or developer, "
                f"function_call and function_call_output items are supported, got "
                f"{kind!r} / {item.get('role')!r}",
                param="input",
            )
    if not messages:
        raise OpenAIServingError("input must not be empty", param="input")
    return messages


def _add_call(messages: list[dict[str, Any]], item: dict[str, Any], i: int) -> None:
    call = {
        "id": _string(item, "call_id", i),
        "type": "function",
        "function": {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)},
    }
    # Calls made in one turn (and the text before them) are one assistant message.
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _string(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise OpenAIServingError(
            f"input[{i}]: a {item.get('type')} item needs {key!r} (a string)", param="input"
        )
    return value


def _text(content: Any, i: int, key: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in _TEXT_PARTS:
                raise OpenAIServingError(
                    f"input[{i}]: only text content is supported, got a {kind!r} part",
                    param="input",
                )
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise OpenAIServingError(f"input[{i}].{key} must be text or parts", param="input")
