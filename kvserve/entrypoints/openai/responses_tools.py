"""Function tools on /v1/responses, through the chat path's tool machinery.

The Responses shapes (flat ``{"type": "function", "name", "parameters"}`` tools,
``{"type": "function", "name"}`` tool_choice) become the chat ones, so ChatToolHandler
enforces tool_choice with its grammar and reads calls with the server's tool call parser;
its results come back as Responses output items: a ``message`` for text, a
``function_call`` per call, after a ``reasoning`` item for what a reasoning parser split
off (serving_chat_reasoning.py).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIServingError
from kvserve.entrypoints.openai.protocol_responses import (
    ItemStatus,
    ResponseFunctionToolCall,
    ResponseOutputItem,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponseReasoningText,
    ResponsesRequest,
)
from kvserve.entrypoints.openai.protocol_structured import DeltaToolCall
from kvserve.entrypoints.openai.serving_chat import OpenAIServingChat
from kvserve.entrypoints.openai.serving_chat_reasoning import (
    ChatReasoningHandler,
    ChoiceReasoningStreamer,
)
from kvserve.entrypoints.openai.serving_chat_tools import ChatToolHandler, ChoiceToolStreamer

_FUNCTION_FIELDS = ("name", "description", "parameters", "strict")
# A server-sent event before its sequence number: (type, body).
Event = tuple[str, dict[str, Any]]


class ResponsesTools:
    """One request's tools; raises OpenAIServingError (400) for what it cannot honour."""

    def __init__(self, request: ResponsesRequest, chat: OpenAIServingChat) -> None:
        self.template_tools = [_chat_tool(tool, i) for i, tool in enumerate(request.tools or [])]
        try:
            as_chat = ChatCompletionRequest.model_validate(
                {
                    "messages": [],
                    "tools": self.template_tools or None,
                    "tool_choice": _chat_tool_choice(request.tool_choice),
                    "parallel_tool_calls": request.parallel_tool_calls,
                }
            )
        except ValidationError as exc:
            raise OpenAIServingError(f"invalid tools: {exc}", param="tools") from None
        self.handler = ChatToolHandler(as_chat, chat.tool_parser)

    def output_items(self, text: str, incomplete: bool) -> list[ResponseOutputItem]:
        """A finished output's items: its text (if any, or if nothing else) and its calls."""
        content, calls = self.handler.parse(text) if self.handler.parses_output else (text, [])
        status: ItemStatus = "incomplete" if incomplete else "completed"
        items: list[ResponseOutputItem] = []
        if content or not calls:
            items.append(
                ResponseOutputMessage(
                    status=status, content=[ResponseOutputText(text=content or "")]
                )
            )
        items += [
            ResponseFunctionToolCall(
                call_id=c.id, name=c.function.name, arguments=c.function.arguments, status=status
            )
            for c in calls
        ]
        return items

    @staticmethod
    def reasoning_items(thought: str | None, incomplete: bool) -> list[ResponseOutputItem]:
        """The reasoning item of a finished output (none when it did not reason)."""
        if thought is None:
            return []
        status: ItemStatus = "incomplete" if incomplete else "completed"
        return [ResponseReasoningItem(status=status, content=[ResponseReasoningText(text=thought)])]

    def streamer(self, reasoning: ChatReasoningHandler) -> OutputItemStreamer:
        tools = self.handler.streamer() if self.handler.parses_output else None
        return OutputItemStreamer(tools, reasoning.streamer(), reasoning.parser is not None)


class OutputItemStreamer:
    """Turns text deltas into the Responses stream's item events; ``finish`` closes the
    items it opened and returns them as they were sent. Reasoning (first, when the model
    reasons) is closed by the first content or call."""

    def __init__(
        self, tools: ChoiceToolStreamer | None, thinker: ChoiceReasoningStreamer, reasons: bool
    ) -> None:
        self.tools = tools
        self.thinker = thinker
        self.reasons = reasons  # a reasoning parser is on: a reasoning item may come first
        self.items: list[ResponseOutputItem] = []
        self.reasoning: ResponseReasoningItem | None = None
        self.message: ResponseOutputMessage | None = None
        self.calls: dict[int, ResponseFunctionToolCall] = {}  # by the tool call's index

    def start(self) -> list[Event]:
        """Without tools or reasoning a message is all there will be: it opens at once."""
        return self._open_message() if self.tools is None and not self.reasons else []

    def feed(self, delta: str, finished: bool) -> list[Event]:
        thought, delta = self.thinker.feed(delta, finished)
        events = self._reason(thought)
        content, calls = self.tools.feed(delta, finished) if self.tools else (delta, [])
        if content or calls:
            events += self._close_reasoning()
        if content:
            if self.message is None:
                events += self._open_message()
            assert self.message is not None
            self.message.content[0].text += content
            body = {**self._where(), "delta": content, "logprobs": []}
            events.append(("response.output_text.delta", body))
        for call in calls:
            events += self._call_delta(call)
        return events

    def finish(self, incomplete: bool) -> tuple[list[Event], list[ResponseOutputItem]]:
        events = self._close_reasoning()
        if self.message is None and not self.calls:
            events += self._open_message()
        for index, item in enumerate(self.items):
            if isinstance(item, ResponseReasoningItem):
                continue  # closed above, as the stream showed it
            item.status = "incomplete" if incomplete else "completed"
            if isinstance(item, ResponseOutputMessage):
                part = item.content[0].model_dump()
                where = self._where()
                events.append(
                    ("response.output_text.done", {**where, "text": part["text"], "logprobs": []})
                )
                events.append(("response.content_part.done", {**where, "part": part}))
            else:
                events.append(
                    (
                        "response.function_call_arguments.done",
                        {"item_id": item.id, "output_index": index, "arguments": item.arguments},
                    )
                )
            events.append(
                ("response.output_item.done", {"output_index": index, "item": item.model_dump()})
            )
        return events, self.items

    def _reason(self, thought: str) -> list[Event]:
        if not thought:
            return []
        events: list[Event] = []
        if self.reasoning is None:
            self.reasoning = ResponseReasoningItem(content=[ResponseReasoningText(text="")])
            events += self._added(self.reasoning)
        self.reasoning.content[0].text += thought
        body = {**self._reasoning_where(), "delta": thought}
        return [*events, ("response.reasoning_text.delta", body)]

    def _close_reasoning(self) -> list[Event]:
        item = self.reasoning
        if item is None or item.status == "completed":
            return []
        item.status = "completed"
        where = self._reasoning_where()
        done = {**where, "text": item.content[0].text}
        body = {"output_index": where["output_index"], "item": item.model_dump()}
        return [("response.reasoning_text.done", done), ("response.output_item.done", body)]

    def _reasoning_where(self) -> dict[str, Any]:
        assert self.reasoning is not None
        index = self.items.index(self.reasoning)
        return {"item_id": self.reasoning.id, "output_index": index, "content_index": 0}

    def _open_message(self) -> list[Event]:
        self.message = ResponseOutputMessage(content=[ResponseOutputText(text="")])
        added = self._added(self.message)
        part = ResponseOutputText(text="").model_dump()
        return [*added, ("response.content_part.added", {**self._where(), "part": part})]

    def _call_delta(self, delta: DeltaToolCall) -> list[Event]:
        function = delta.function
        call = self.calls.get(delta.index)
        events: list[Event] = []
        if call is None:
            assert delta.id is not None and function is not None and function.name is not None
            call = ResponseFunctionToolCall(
                call_id=delta.id, name=function.name, arguments="", status="in_progress"
            )
            self.calls[delta.index] = call
            events += self._added(call)
        if function is not None and function.arguments:
            call.arguments += function.arguments
            body = {
                "item_id": call.id,
                "output_index": self.items.index(call),
                "delta": function.arguments,
            }
            events.append(("response.function_call_arguments.delta", body))
        return events

    def _added(self, item: ResponseOutputItem) -> list[Event]:
        self.items.append(item)
        body = {"output_index": len(self.items) - 1, "item": item.model_dump()}
        return [("response.output_item.added", body)]

    def _where(self) -> dict[str, Any]:
        assert self.message is not None
        index = self.items.index(self.message)
        return {"item_id": self.message.id, "output_index": index, "content_index": 0}


def _chat_tool(tool: Any, i: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise OpenAIServingError(
            f"tools[{i}]: only function tools are supported, got {kind!r}", param="tools"
        )
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise OpenAIServingError(f"tools[{i}] needs a name (a string)", param="tools")
    function = {k: tool[k] for k in _FUNCTION_FIELDS if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise OpenAIServingError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}, '
        f"got {choice!r}",
        param="tool_choice",
    )
