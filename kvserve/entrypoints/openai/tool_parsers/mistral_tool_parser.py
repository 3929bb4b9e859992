"""Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (tokenizers up to v7),
or one ``[TOOL_CALLS]name[ARGS]{...}`` per call (v11 and later, where a ``[CALL_ID]id``
may sit between the name and ``[ARGS]``)."""

from __future__ import annotations

import json
import re
from typing import Any

from kvserve.entrypoints.openai.protocol_structured import ToolCall
from kvserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    ToolParser,
    ToolParserManager,
    function_call,
)
from kvserve.entrypoints.openai.tool_parsers.markers import partial_suffix

BOT = "[TOOL_CALLS]"
_NAMED = re.compile(r"\s*([^\[\]\s]+)\s*(?:\[CALL_ID\]\s*\S+?\s*)?\[ARGS\]")


@ToolParserManager.register_module("mistral")
class MistralToolParser(ToolParser):
    keeps_special_tokens = True

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCallInformation:
        start = model_output.find(BOT)
        if start < 0:
            return ExtractedToolCallInformation(False, content=model_output)
        calls: list[ToolCall] = []
        try:
            for segment in model_output[start:].split(BOT)[1:]:
                calls.extend(_segment_calls(segment))
        except ValueError:
            return ExtractedToolCallInformation(False, content=model_output)
        content = model_output[:start].strip() or None
        return ExtractedToolCallInformation(bool(calls), calls, content)

    def tool_call_start(self, text: str) -> int | None:
        start = text.find(BOT)
        return None if start < 0 else start

    def num_held_back(self, text: str) -> int:
        return partial_suffix(text, (BOT,))


def _segment_calls(segment: str) -> list[ToolCall]:
    """The calls after one [TOOL_CALLS]: a JSON array (or object), or name[ARGS]{...}."""
    decoder = json.JSONDecoder()
    named = _NAMED.match(segment)
    if named:
        arguments, _ = decoder.raw_decode(segment, named.end())
        return [function_call(named.group(1), _object(arguments))]
    body = segment.strip()
    parsed, _ = decoder.raw_decode(body)
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ValueError("a tool call needs a name")
        calls.append(function_call(item["name"], _object(item.get("arguments", {}))))
    return calls


def _object(arguments: Any) -> Any:
    if not isinstance(arguments, dict | str):
        raise ValueError("arguments must be an object")
    return arguments
