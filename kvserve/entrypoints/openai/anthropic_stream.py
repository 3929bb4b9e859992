"""Anthropic's stream events from a chat completion stream (one choice).

The chat path streams OpenAI chunks; this turns them into ``message_start``, ``ping``,
``content_block_start`` / ``content_block_delta`` (``text_delta``, ``input_json_delta``) /
``content_block_stop`` per text run or tool call, then ``message_delta`` (stop reason,
usage) and ``message_stop``. An error chunk becomes Anthropic's ``error`` event.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from kvserve.entrypoints.openai.anthropic_errors import anthropic_error, sse_event
from kvserve.entrypoints.openai.protocol_anthropic import (
    AnthropicMessagesResponse,
    AnthropicUsage,
    StopReason,
)


def anthropic_message_id(chat_id: str) -> str:
    return "msg_" + chat_id.removeprefix("chatcmpl-")


def anthropic_tool_id(chat_tool_id: str) -> str:
    """Anthropic's ``toolu_`` id for the chat path's tool call id (same uniqueness)."""
    return "toolu_" + chat_tool_id.removeprefix("chatcmpl-tool-")


def stop_reason_of(
    finish_reason: str | None, stop_reason: int | str | None, tool_calls: bool
) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence) for a chat choice's finish."""
    if finish_reason == "length":
        return "max_tokens", None
    if tool_calls:
        return "tool_use", None
    if isinstance(stop_reason, str):  # the stop string matched (an int is a stop token)
        return "stop_sequence", stop_reason
    return "end_turn", None


class MessageStreamConverter:
    """Owns one stream's state: the open content block and the usage seen so far."""

    def __init__(self) -> None:
        self.started = False
        # The chat stream always opens with its role chunk.
        self.last_chunk: dict[str, Any] = {}
        self.num_blocks = 0
        self.open_block: int | None = None
        self.open_kind: str | None = None
        # The chat stream's tool call index -> its content block index.
        self.tool_blocks: dict[int, int] = {}
        self.input_tokens = 0
        self.output_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    async def events(self, chunks: AsyncIterator[str]) -> AsyncGenerator[str, None]:
        """Closing this generator closes ``chunks`` (and so aborts the engine request)."""
        async with contextlib.aclosing(chunks):  # type: ignore[type-var]
            async for line in chunks:
                data = line.removeprefix("data: ").strip()
                if data == "[DONE]":
                    break
                body = json.loads(data)
                if "error" in body:
                    error = body["error"]
                    _, anthropic = anthropic_error(int(error["code"]), error["message"])
                    yield sse_event("error", anthropic.model_dump())
                    return
                for event in self._feed(body):
                    yield event
        for event in self._finish():
            yield event

    def _feed(self, chunk: dict[str, Any]) -> list[str]:
        events: list[str] = []
        self.last_chunk = chunk
        usage = chunk.get("usage")
        if usage:
            self.input_tokens = usage["prompt_tokens"]
            self.output_tokens = usage["completion_tokens"]
        for choice in chunk["choices"]:
            delta = choice["delta"]
            thinking: str | None = delta.get("reasoning_content")
            content: str | None = delta.get("content")
            calls: list[dict[str, Any]] = delta.get("tool_calls") or []
            if not (thinking or content or calls or choice.get("finish_reason")):
                continue  # the role chunk: message_start waits for the usage
            events += self._start(chunk)
            if thinking:
                events += self._running_block("thinking", thinking)
            if content:
                events += self._running_block("text", content)
            for call in calls:
                events += self._tool_call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.stop_reason = choice.get("stop_reason")
        return events

    def _start(self, chunk: dict[str, Any]) -> list[str]:
        """message_start (once), named after the chat chunks' id and model."""
        if self.started:
            return []
        self.started = True
        message = AnthropicMessagesResponse(
            id=anthropic_message_id(chunk["id"]),
            model=chunk["model"],
            usage=AnthropicUsage(input_tokens=self.input_tokens, output_tokens=0),
        )
        return [
            sse_event("message_start", {"type": "message_start", "message": message.model_dump()}),
            sse_event("ping", {"type": "ping"}),
        ]

    def _open(self, block: dict[str, Any]) -> list[str]:
        events = self._close()
        self.open_block, self.open_kind = self.num_blocks, block["type"]
        self.num_blocks += 1
        body = {"type": "content_block_start", "index": self.open_block, "content_block": block}
        return [*events, sse_event("content_block_start", body)]

    def _close(self) -> list[str]:
        if self.open_block is None:
            return []
        index, self.open_block = self.open_block, None
        return [sse_event("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _delta(self, index: int, delta: dict[str, Any]) -> str:
        body = {"type": "content_block_delta", "index": index, "delta": delta}
        return sse_event("content_block_delta", body)

    def _running_block(self, kind: str, text: str) -> list[str]:
        """``text`` appended to the open block of ``kind`` ("text" or "thinking"), or to a
        new one."""
        events: list[str] = []
        if self.open_block is None or self.open_kind != kind:
            # No signature: the reasoning is the server's own, nothing to verify.
            block = {"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {})
            events = self._open(block)
        assert self.open_block is not None
        delta = {"type": f"{kind}_delta", kind: text}
        return [*events, self._delta(self.open_block, delta)]

    def _tool_call(self, call: dict[str, Any]) -> list[str]:
        events: list[str] = []
        function = call.get("function") or {}
        if call["index"] not in self.tool_blocks:
            block: dict[str, Any] = {
                "type": "tool_use",
                "id": anthropic_tool_id(call.get("id") or ""),
                "name": function.get("name") or "",
                "input": {},
            }
            events = self._open(block)
            assert self.open_block is not None
            self.tool_blocks[call["index"]] = self.open_block
        arguments = function.get("arguments")
        if arguments:
            delta = {"type": "input_json_delta", "partial_json": arguments}
            events.append(self._delta(self.tool_blocks[call["index"]], delta))
        return events

    def _finish(self) -> list[str]:
        events = [*self._start(self.last_chunk), *self._close()]
        stop_reason, stop_sequence = stop_reason_of(
            self.finish_reason, self.stop_reason, bool(self.tool_blocks)
        )
        body = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens},
        }
        events.append(sse_event("message_delta", body))
        events.append(sse_event("message_stop", {"type": "message_stop"}))
        return events
