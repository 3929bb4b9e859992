"""Hermes / Qwen style: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

from __future__ import annotations

import json
import re

from kvserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    ToolParser,
    ToolParserManager,
    function_call,
)

START, END = "<tool_call>", "</tool_call>"
# A call is closed by its end tag, or by the end of the output (a model stopping early).
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@ToolParserManager.register_module("hermes")
class Hermes2ProToolParser(ToolParser):
    def extract_tool_calls(self, model_output: str) -> ExtractedToolCallInformation:
        start = model_output.find(START)
        if start < 0:
            return ExtractedToolCallInformation(False, content=model_output)
        calls = []
        try:
            for body in _CALL.findall(model_output[start:]):
                parsed = json.loads(body)
                if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
                    raise ValueError("a tool call needs a name")
                calls.append(function_call(parsed["name"], parsed.get("arguments", {})))
        except ValueError:
            return ExtractedToolCallInformation(False, content=model_output)
        content = model_output[:start].strip() or None
        return ExtractedToolCallInformation(bool(calls), calls, content)

    def tool_call_start(self, text: str) -> int | None:
        start = text.find(START)
        return None if start < 0 else start

    def num_held_back(self, text: str) -> int:
        for n in range(min(len(START) - 1, len(text)), 0, -1):
            if START.startswith(text[-n:]):
                return n
        return 0
