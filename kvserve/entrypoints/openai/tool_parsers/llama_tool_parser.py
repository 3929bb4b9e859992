"""Llama 3.x JSON style: the whole output is ``{"name": ..., "parameters": {...}}``, several
calls separated by ``;``, optionally after ``<|python_tag|>``."""

from __future__ import annotations

import json

from kvserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    ToolParser,
    ToolParserManager,
    function_call,
)

PYTHON_TAG = "<|python_tag|>"


@ToolParserManager.register_module("llama3_json")
class Llama3JsonToolParser(ToolParser):
    def extract_tool_calls(self, model_output: str) -> ExtractedToolCallInformation:
        text = model_output.strip().removeprefix(PYTHON_TAG).strip()
        if not text.startswith("{"):
            return ExtractedToolCallInformation(False, content=model_output)
        decoder, calls, pos = json.JSONDecoder(), [], 0
        try:
            while pos < len(text):
                parsed, pos = decoder.raw_decode(text, pos)
                if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
                    raise ValueError("a tool call needs a name")
                arguments = parsed.get("parameters", parsed.get("arguments", {}))
                calls.append(function_call(parsed["name"], arguments))
                pos = _skip_separator(text, pos)
        except ValueError:
            return ExtractedToolCallInformation(False, content=model_output)
        return ExtractedToolCallInformation(True, calls, None)

    def tool_call_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith("{") or stripped.startswith(PYTHON_TAG):
            return 0
        return None

    def num_held_back(self, text: str) -> int:
        stripped = text.lstrip()
        # Only the output's start can open a call: hold back until it has begun.
        if not stripped or PYTHON_TAG.startswith(stripped):
            return len(text)
        return 0


def _skip_separator(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n;":
        pos += 1
    return pos
