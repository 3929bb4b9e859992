"""IBM Granite 3.x: ``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`` (3.1 and later
may write ``<tool_call>`` instead) at the start of the output."""

from __future__ import annotations

import json

from kvserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    ToolParser,
    ToolParserManager,
    function_call,
)
from kvserve.entrypoints.openai.tool_parsers.markers import held_at_start

OPENERS = ("<|tool_call|>", "<tool_call>")


@ToolParserManager.register_module("granite")
class GraniteToolParser(ToolParser):
    keeps_special_tokens = True

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCallInformation:
        text = model_output.strip()
        for opener in OPENERS:
            text = text.removeprefix(opener)
        text = text.strip()
        if not text.startswith("["):
            return ExtractedToolCallInformation(False, content=model_output)
        try:
            items, _ = json.JSONDecoder().raw_decode(text)
            if not isinstance(items, list):
                raise ValueError("the calls are a JSON array")
            calls = []
            for item in items:
                if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                    raise ValueError("a tool call needs a name")
                calls.append(function_call(item["name"], item.get("arguments", {})))
        except ValueError:
            return ExtractedToolCallInformation(False, content=model_output)
        return ExtractedToolCallInformation(bool(calls), calls, None)

    def tool_call_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        return 0 if stripped.startswith((*OPENERS, "[")) else None

    def num_held_back(self, text: str) -> int:
        return held_at_start(text, OPENERS)
