"""Qwen3-Coder's XML calls::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is its text; one that reads as JSON other than a string (a number,
true, an object) becomes that value, as the model writes non-string arguments that way.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    ToolParser,
    ToolParserManager,
    function_call,
)
from kvserve.entrypoints.openai.tool_parsers.markers import find_first, partial_suffix

# Calls open with <tool_call>; a model that skips it still opens with <function=.
OPENERS = ("<tool_call>", "<function=")
_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


@ToolParserManager.register_module("qwen3_coder")
class Qwen3CoderToolParser(ToolParser):
    def extract_tool_calls(self, model_output: str) -> ExtractedToolCallInformation:
        start = find_first(model_output, OPENERS)
        if start is None:
            return ExtractedToolCallInformation(False, content=model_output)
        calls = [
            function_call(name, {k: _value(v) for k, v in _PARAMETER.findall(body)})
            for name, body in _FUNCTION.findall(model_output[start:])
        ]
        content = model_output[:start].strip() or None
        if not calls:
            return ExtractedToolCallInformation(False, content=model_output)
        return ExtractedToolCallInformation(True, calls, content)

    def tool_call_start(self, text: str) -> int | None:
        return find_first(text, OPENERS)

    def num_held_back(self, text: str) -> int:
        return partial_suffix(text, OPENERS)


def _value(text: str) -> Any:
    # The template writes one newline around each value.
    text = text.removeprefix("\n").removesuffix("\n")
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return text if isinstance(value, str) else value
