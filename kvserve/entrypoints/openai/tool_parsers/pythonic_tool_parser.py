"""Pythonic calls (Llama 3.2 / 4, ToolACE): ``[get_weather(city="Paris"), get_time(tz="CET")]``
as the whole output, optionally inside ``<|python_start|>...<|python_end|>``. Read with
``ast``: only literals are accepted as arguments, nothing is evaluated."""

from __future__ import annotations

import ast
from typing import Any

from kvserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    ToolParser,
    ToolParserManager,
    function_call,
)
from kvserve.entrypoints.openai.tool_parsers.markers import held_at_start

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
# Models trained on JSON write its constants too.
_JSON_NAMES: dict[str, Any] = {"true": True, "false": False, "null": None}


@ToolParserManager.register_module("pythonic")
class PythonicToolParser(ToolParser):
    keeps_special_tokens = True

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCallInformation:
        text = model_output.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
        if not text.startswith("["):
            return ExtractedToolCallInformation(False, content=model_output)
        try:
            tree = ast.parse(text, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                raise ValueError("the calls are a list")
            calls = [function_call(*_call(node)) for node in tree.elts]
        except (SyntaxError, ValueError):
            return ExtractedToolCallInformation(False, content=model_output)
        return ExtractedToolCallInformation(True, calls, None)

    def tool_call_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        return 0 if stripped.startswith(("[", PYTHON_START)) else None

    def num_held_back(self, text: str) -> int:
        return held_at_start(text, (PYTHON_START,))


def _call(node: ast.expr) -> tuple[str, dict[str, Any]]:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise ValueError("a call is name(keyword=value, ...)")
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            raise ValueError("**kwargs is not a literal argument")
        arguments[keyword.arg] = _literal(keyword.value)
    return node.func.id, arguments


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("**mapping is not a literal")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)}  # type: ignore[arg-type]
    return ast.literal_eval(node)
