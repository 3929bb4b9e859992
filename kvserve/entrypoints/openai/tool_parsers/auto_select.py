"""``--tool-call-parser auto``: the parser read off the chat template and the tokenizer's
special tokens, as llama.cpp's server detects a model's tool format (no flag needed).

Templates are told apart by the call syntax they teach the model; a template that never
mentions tools gets kvserve's fallback rendering (serving_chat_messages.py), which teaches
hermes' syntax, so hermes reads the calls.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

AUTO = "auto"
_TOOLS_WORD = re.compile(r"\btools\b")
# Llama 3.2 / 4 and ToolACE templates describe the call list by example.
_PYTHONIC_EXAMPLE = re.compile(r"\[\s*func_name\d*\s*\(")


@dataclass(frozen=True)
class ToolParserChoice:
    name: str
    reason: str


def template_text(chat_template: Any) -> str:
    """One searchable text for a template given as a string or as HF's named templates."""
    if isinstance(chat_template, dict):
        return "\n".join(str(t) for t in chat_template.values())
    return chat_template if isinstance(chat_template, str) else ""


def template_supports_tools(chat_template: Any) -> bool:
    """Whether the template renders tools itself (it reads the ``tools`` variable)."""
    return bool(_TOOLS_WORD.search(template_text(chat_template)))


# (parser, why, test on the template text and the tokenizer's vocabulary), first match wins:
# Qwen3-Coder's template also names <tool_call>, so the XML form is tried before hermes.
_RULES: list[tuple[str, str, Callable[[str, Collection[str]], bool]]] = [
    (
        "qwen3_coder",
        "the chat template writes calls as <function=name><parameter=...> XML",
        lambda t, v: "<function=" in t and "<parameter=" in t,
    ),
    (
        "mistral",
        "[TOOL_CALLS] is in the chat template or the tokenizer's vocabulary",
        lambda t, v: "[TOOL_CALLS]" in t or "[TOOL_CALLS]" in v,
    ),
    (
        "granite",
        "<|tool_call|> is in the chat template or the tokenizer's vocabulary",
        lambda t, v: "<|tool_call|>" in t or "<|tool_call|>" in v,
    ),
    (
        "pythonic",
        "the chat template asks for calls as a Python list [func_name(param=value)]",
        lambda t, v: bool(_PYTHONIC_EXAMPLE.search(t)) or "<|python_start|>" in t,
    ),
    (
        "hermes",
        "the chat template writes calls inside <tool_call></tool_call>",
        lambda t, v: "<tool_call>" in t,
    ),
    (
        "llama3_json",
        "the chat template asks for JSON calls with <|python_tag|> or ipython results",
        lambda t, v: "<|python_tag|>" in t or ("ipython" in t and '"parameters"' in t),
    ),
]


def select_tool_parser(chat_template: Any, vocab: Collection[str]) -> ToolParserChoice:
    """The parser for a template (string, HF's dict of named ones, or None) and a vocabulary."""
    text = template_text(chat_template)
    if not template_supports_tools(text):
        return ToolParserChoice(
            "hermes",
            "the chat template has no tool support: tools, calls and results are rendered "
            "in hermes' form, which the model is asked to answer in",
        )
    for name, reason, matches in _RULES:
        if matches(text, vocab):
            return ToolParserChoice(name, reason)
    return ToolParserChoice("hermes", "the chat template's call syntax is not one kvserve knows")


def resolve_tool_parser(flag: str | None, chat_template: Any, tokenizer: Any) -> ToolParserChoice:
    """``--tool-call-parser``: a parser's name is taken as given; ``auto`` (or none) selects."""
    if flag and flag != AUTO:
        return ToolParserChoice(flag, "--tool-call-parser")
    vocab: Collection[str] = tokenizer.get_vocab() if tokenizer is not None else ()
    return select_tool_parser(chat_template, vocab)
