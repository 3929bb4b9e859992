"""ToolParser: turns a model's text into OpenAI tool calls (ABC + registry, vLLM's names).

A parser knows its model family's call syntax: where calls start in the text and how to
read them. Streaming is shared (ToolCallStreamer): text before a call streams as content,
a call is held until it is complete and then sent as ``delta.tool_calls``.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvserve.entrypoints.openai.protocol_structured import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ExtractedToolCallInformation:
    tools_called: bool
    tool_calls: list[ToolCall] = field(default_factory=list)
    # Text outside the calls (None when there is none).
    content: str | None = None


class ToolParser(ABC):
    name: ClassVar[str]
    # Its call markers are special tokens, which detokenizing would otherwise drop.
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @abstractmethod
    def extract_tool_calls(self, model_output: str) -> ExtractedToolCallInformation:
        """The calls in a complete output; none (all content) when it holds no valid call."""

    @abstractmethod
    def tool_call_start(self, text: str) -> int | None:
        """Where the first call starts in ``text`` (a prefix of the output), if it does."""

    @abstractmethod
    def num_held_back(self, text: str) -> int:
        """How many trailing characters of ``text`` may still turn into a call's start
        (streamed content holds them back until it knows)."""


class ToolParserManager:
    """The registry behind ``--tool-call-parser``."""

    tool_parsers: ClassVar[dict[str, type[ToolParser]]] = {}

    @classmethod
    def register_module(cls, name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
        def wrap(parser: type[ToolParser]) -> type[ToolParser]:
            parser.name = name
            cls.tool_parsers[name] = parser
            return parser

        return wrap

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        if name not in cls.tool_parsers:
            raise ValueError(
                f"tool call parser {name!r} is unknown; known: {', '.join(sorted(cls.tool_parsers))}"
            )
        return cls.tool_parsers[name]


def tool_call_deltas(calls: list[ToolCall], first_index: int = 0) -> list[DeltaToolCall]:
    """Whole calls as stream deltas: id, type, name and all arguments in one delta each."""
    return [
        DeltaToolCall(
            index=first_index + i,
            id=call.id,
            type="function",
            function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments),
        )
        for i, call in enumerate(calls)
    ]


class ToolCallStreamer:
    """One choice's stream through a parser: ``feed`` each text delta, get what to send.

    Returns (content, tool_calls) for the delta, either possibly empty.
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of text already sent as content
        self.in_call = False
        self.tools_called = False

    def feed(self, delta_text: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        self.text += delta_text
        content = ""
        if not self.in_call:
            start = self.parser.tool_call_start(self.text)
            if start is not None:
                self.in_call = True
                content, self.sent = self.text[self.sent : start], start
            else:
                end = (
                    len(self.text)
                    if finished
                    else len(self.text) - self.parser.num_held_back(self.text)
                )
                content, self.sent = self.text[self.sent : end], max(end, self.sent)
        if not (finished and self.in_call):
            return content, []
        info = self.parser.extract_tool_calls(self.text)
        if not info.tools_called:
            # Looked like a call but is none: it was content after all.
            return content + self.text[self.sent :], []
        self.tools_called = True
        return content, tool_call_deltas(info.tool_calls)


def function_call(name: str, arguments: Any) -> ToolCall:
    import json

    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=make_tool_call_id(), function=FunctionCall(name=name, arguments=text))
