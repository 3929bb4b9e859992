"""Tool calling for one chat request: tool_choice -> grammar, model text -> tool_calls.

``required`` and a named function are enforced by a JSON-schema grammar (vLLM's scheme), so
their output always parses: a named call's output is its arguments; ``required`` produces
``[{"name": ..., "parameters": {...}}, ...]``. ``auto`` leaves the model free and reads its
calls with the server's tool call parser.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIServingError
from kvserve.entrypoints.openai.protocol_structured import (
    ChatCompletionNamedToolChoiceParam,
    DeltaFunctionCall,
    DeltaToolCall,
    ToolCall,
)
from kvserve.entrypoints.openai.tool_parsers import ToolCallStreamer, ToolParser
from kvserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    function_call,
    make_tool_call_id,
    tool_call_deltas,
)
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams

ToolMode = Literal["none", "auto", "required", "named"]
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


class ChatToolHandler:
    """Raises OpenAIServingError (400) on construction for a tool_choice it cannot honour."""

    def __init__(
        self,
        request: ChatCompletionRequest,
        tool_parser: ToolParser | None,
    ) -> None:
        self.tools = {t.function.name: t.function for t in request.tools or []}
        self.parser = tool_parser
        self.parallel = request.parallel_tool_calls is not False
        choice = request.tool_choice
        self.named: str | None = None
        if isinstance(choice, ChatCompletionNamedToolChoiceParam):
            self.named = choice.function.name
            if self.named not in self.tools:
                raise OpenAIServingError(
                    f"tool_choice names function {self.named!r}, which is not among the tools",
                    param="tool_choice",
                )
            self.mode: ToolMode = "named"
        elif choice is None:
            self.mode = "auto" if self.tools and tool_parser is not None else "none"
        else:
            self.mode = choice
        if self.mode != "none" and not self.tools:
            raise OpenAIServingError(f"tool_choice {self.mode!r} needs tools", param="tool_choice")
        if self.mode == "auto" and tool_parser is None:
            raise OpenAIServingError(
                '"auto" tool choice needs a tool call parser', param="tool_choice"
            )

    @property
    def parses_output(self) -> bool:
        return self.mode in ("auto", "required", "named")

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The grammar that enforces the calls (None for none and auto)."""
        if self.mode == "named":
            assert self.named is not None
            return StructuredOutputsParams(
                json=self._parameters(self.named), disable_any_whitespace=True
            )
        if self.mode == "required":
            items = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [name]},
                        "parameters": self._parameters(name),
                    },
                    "required": ["name", "parameters"],
                }
                for name in self.tools
            ]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
            if not self.parallel:
                schema["maxItems"] = 1
            # Compact JSON: fewer tokens, so max_tokens cuts fewer calls short.
            return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        return None

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """``params`` with what the tool choice needs: its grammar (which excludes the
        request's own), the parser's marker tokens kept in the text."""
        grammar = self.structured_outputs()
        if grammar is not None:
            if params.structured_outputs is not None:
                raise ValueError(
                    "tool_choice required or a named function is enforced by a grammar: "
                    "it cannot be combined with response_format or structured_outputs"
                )
            params = params.clone(structured_outputs=grammar)
        if self.mode == "auto" and self.parser is not None and self.parser.keeps_special_tokens:
            params = params.clone(skip_special_tokens=False)
        return params

    def _parameters(self, name: str) -> dict[str, Any]:
        return self.tools[name].parameters or _ANY_OBJECT

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool_calls) of a finished output."""
        if self.mode == "named":
            assert self.named is not None
            return None, [function_call(self.named, text)]
        if self.mode == "required":
            calls = _complete_array_items(text)
            if not calls:
                return text, []  # cut short before one call was complete: as content
            return None, [function_call(c["name"], c["parameters"]) for c in calls]
        if self.mode == "auto":
            assert self.parser is not None
            info = self.parser.extract_tool_calls(text)
            if info.tools_called:
                return info.content, info.tool_calls
        return text, []

    def finish_reason(self, finish_reason: str | None, tool_calls: bool) -> str | None:
        # OpenAI: "tool_calls" when the model chose to call; a forced named call is "stop".
        if finish_reason == "stop" and tool_calls and self.mode in ("auto", "required"):
            return "tool_calls"
        return finish_reason

    def streamer(self) -> ChoiceToolStreamer:
        return ChoiceToolStreamer(self)


class ChoiceToolStreamer:
    """One choice's stream: ``feed`` each text delta, get (content, tool call deltas)."""

    def __init__(self, handler: ChatToolHandler) -> None:
        self.handler = handler
        self.text = ""
        self.tools_called = False
        self.auto = (
            ToolCallStreamer(handler.parser) if handler.mode == "auto" and handler.parser else None
        )
        self.named_id = make_tool_call_id()

    def feed(self, delta: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        mode = self.handler.mode
        if self.auto is not None:
            content, calls = self.auto.feed(delta, finished)
            self.tools_called = self.auto.tools_called
            return content, calls
        if mode == "named":
            # The output is the arguments: stream them as they come, the name first.
            first = not self.text
            self.text += delta
            self.tools_called = True
            if not (first or delta):
                return "", []
            function = DeltaFunctionCall(arguments=delta)
            if first:
                function.name = self.handler.named
            call = DeltaToolCall(index=0, function=function)
            if first:
                call.id, call.type = self.named_id, "function"
            return "", [call]
        if mode == "required":
            # The array becomes calls only once complete.
            self.text += delta
            if not finished:
                return "", []
            text, parsed = self.handler.parse(self.text)
            self.tools_called = bool(parsed)
            return text or "", tool_call_deltas(parsed)
        return delta, []


def _complete_array_items(text: str) -> list[dict[str, Any]]:
    """The complete objects of a JSON array, also of one cut short (max_tokens): the grammar
    guarantees every complete item is a valid call."""
    decoder, items = json.JSONDecoder(), []
    pos = text.find("[") + 1
    while 0 < pos < len(text):
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except ValueError:
            break
        if not isinstance(item, dict) or "name" not in item or "parameters" not in item:
            break
        items.append(item)
    return items
