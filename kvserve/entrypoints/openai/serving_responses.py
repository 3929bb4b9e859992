"""`POST /v1/responses`: OpenAI's Responses API over the chat template, whole or streamed.

Input is text or a list of messages (text content, or input_text / output_text parts);
``instructions`` become a system message placed first. One assistant message comes back.
Responses are kept (for ``GET /v1/responses/{id}`` and ``previous_response_id``) only when
the server runs with ``--enable-store-responses``, in memory and bounded.
"""

from __future__ import annotations

import contextlib
import json
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from fastapi import Request

from kvserve.entrypoints.openai.protocol import OpenAIServingError
from kvserve.entrypoints.openai.protocol_responses import (
    IncompleteDetails,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponseReasoningText,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
)
from kvserve.entrypoints.openai.serving_chat import OpenAIServingChat
from kvserve.entrypoints.openai.serving_chat_reasoning import ChatReasoningHandler
from kvserve.entrypoints.openai.serving_engine import OpenAIServing
from kvserve.outputs import RequestOutput

# Stored responses kept at most (oldest dropped first), with their conversations.
MAX_STORED_RESPONSES = 1024
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def _message_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text"):
                raise OpenAIServingError(
                    f"input[{index}]: only text content is supported, got a {kind!r} part",
                    param="input",
                )
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise OpenAIServingError(f"input[{index}].content must be text or parts", param="input")


def input_messages(request: ResponsesRequest) -> list[dict[str, str]]:
    """The request's input as chat messages (instructions not included)."""
    if isinstance(request.input, str):
        return [{"role": "user", "content": request.input}]
    messages: list[dict[str, str]] = []
    for i, item in enumerate(request.input):
        role = _ROLES.get(str(item.get("role")))
        if item.get("type", "message") != "message" or role is None:
            raise OpenAIServingError(
                f"input[{i}]: only messages with role user, assistant, system or developer "
                f"are supported, got {item.get('type', 'message')!r} / {item.get('role')!r}",
                param="input",
            )
        messages.append({"role": role, "content": _message_text(item.get("content"), i)})
    if not messages:
        raise OpenAIServingError("input must not be empty", param="input")
    return messages


class OpenAIServingResponses(OpenAIServing):
    def __init__(self, chat: OpenAIServingChat, enable_store: bool = False) -> None:
        super().__init__(chat.engine_client, chat.models)
        self.chat = chat
        self.enable_store = enable_store
        # id -> (response, the conversation it answered, without instructions).
        self.store: OrderedDict[str, tuple[ResponsesResponse, list[dict[str, str]]]] = OrderedDict()

    def retrieve(self, response_id: str) -> ResponsesResponse:
        if response_id not in self.store:
            raise OpenAIServingError(f"Response with id {response_id!r} not found.", status=404)
        return self.store[response_id][0]

    def _history(self, request: ResponsesRequest) -> list[dict[str, str]]:
        if request.previous_response_id is None:
            return []
        if not self.enable_store:
            raise OpenAIServingError(
                "previous_response_id needs a server started with --enable-store-responses",
                param="previous_response_id",
            )
        previous = self.retrieve(request.previous_response_id)
        _, conversation = self.store[previous.id]
        return [*conversation, {"role": "assistant", "content": previous.output_text}]

    async def create_response(
        self, request: ResponsesRequest, raw_request: Request | None = None
    ) -> ResponsesResponse | AsyncIterator[str]:
        """A ResponsesResponse, or (stream=True) an iterator of SSE events."""
        model = self.models.resolve(request.model)
        if request.tools:
            raise OpenAIServingError("tools are not supported on /v1/responses", param="tools")
        conversation = [*self._history(request), *input_messages(request)]
        system = (
            [{"role": "system", "content": request.instructions}] if request.instructions else []
        )
        text, prompt_ids = await self.chat.render_prompt(
            [*system, *conversation], True, False, None
        )
        max_tokens = self.check_length(len(prompt_ids), request.max_output_tokens, "input")
        reasoning = ChatReasoningHandler(self.chat.reasoning_parser, text, include=True)
        try:
            params = reasoning.sampling_params(
                request.to_sampling_params(max_tokens, self.default_sampling_params)
            )
        except ValueError as exc:
            raise self.bad_request(exc) from None
        request_id = self.request_id(raw_request, request.request_id, "resp")
        response = ResponsesResponse(
            id=self.response_id(request_id, "resp").replace("resp-", "resp_", 1),
            model=model,
            instructions=request.instructions,
            max_output_tokens=request.max_output_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            previous_response_id=request.previous_response_id,
            metadata=request.metadata,
            store=request.store and self.enable_store,
        )
        outputs = self.generate(
            {"prompt_token_ids": prompt_ids, "prompt": text},
            params,
            request_id,
            request.priority,
            request.cache_salt,
        )
        if not request.stream:
            final: RequestOutput | None = None
            try:
                async with contextlib.aclosing(outputs):
                    async for output in outputs:
                        self.check_output(output)
                        final = output
            except Exception as exc:
                raise self.engine_error(exc) from None
            assert final is not None
            sample = final.outputs[0]
            thought, content = reasoning.split(sample.text)
            self._finish(response, final, len(prompt_ids), thought, content, len(sample.token_ids))
            self._store(response, conversation)
            return response
        try:
            first = await anext(outputs)
        except Exception as exc:
            await outputs.aclose()
            raise self.engine_error(exc) from None
        return self._stream(response, outputs, first, len(prompt_ids), conversation, reasoning)

    def _finish(
        self,
        response: ResponsesResponse,
        final: RequestOutput,
        prompt_tokens: int,
        thought: str | None,
        text: str,
        output_tokens: int,
    ) -> tuple[ResponseReasoningItem | None, ResponseOutputMessage]:
        """Completes ``response`` from the last output: its reasoning (if any) and message."""
        sample = final.outputs[0]
        incomplete = sample.finish_reason == "length"
        response.status = "incomplete" if incomplete else "completed"
        if incomplete:
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        message = ResponseOutputMessage(
            status=response.status, content=[ResponseOutputText(text=text)]
        )
        item = None
        if thought is not None:
            item = ResponseReasoningItem(
                status=response.status, content=[ResponseReasoningText(text=thought)]
            )
        response.output = [message] if item is None else [item, message]
        response.usage = ResponseUsage.of(
            prompt_tokens, output_tokens, final.num_cached_tokens or 0
        )
        return item, message

    def _store(self, response: ResponsesResponse, conversation: list[dict[str, str]]) -> None:
        if response.store:
            self.store[response.id] = (response, conversation)
            while len(self.store) > MAX_STORED_RESPONSES:
                self.store.popitem(last=False)

    async def _stream(
        self,
        response: ResponsesResponse,
        outputs: AsyncGenerator[RequestOutput, None],
        first: RequestOutput,
        prompt_tokens: int,
        conversation: list[dict[str, str]],
        reasoning: ChatReasoningHandler,
    ) -> AsyncGenerator[str, None]:
        sequence = 0

        def event(kind: str, **body: Any) -> str:
            nonlocal sequence
            data = {"type": kind, "sequence_number": sequence, **body}
            sequence += 1
            return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

        items = _StreamItems(event)
        yield event("response.created", response=response.model_dump())
        yield event("response.in_progress", response=response.model_dump())
        if reasoning.parser is None:  # no reasoning item can come: the message opens at once
            for line in items.open_message():
                yield line
        thinker = reasoning.streamer()
        text: list[str] = []
        output_tokens = 0
        try:
            async with contextlib.aclosing(outputs):
                output: RequestOutput | None = first
                final = first
                while output is not None:
                    self.check_output(output)
                    final = output
                    sample = output.outputs[0]
                    output_tokens += len(sample.token_ids)
                    thought, delta = thinker.feed(sample.text, sample.finish_reason is not None)
                    for line in items.reason(thought):
                        yield line
                    if delta:
                        for line in items.open_message():
                            yield line
                        text.append(delta)
                        yield event(
                            "response.output_text.delta", delta=delta, logprobs=[], **items.where
                        )
                    output = await anext(outputs, None)
            for line in items.open_message():  # closes the reasoning, if it is open
                yield line
            item, done = self._finish(
                response, final, prompt_tokens, items.thought, "".join(text), output_tokens
            )
            self._store(response, conversation)
            if item is not None and items.reasoning is not None:
                item.id = items.reasoning.id
            assert items.message is not None
            done.id = items.message.id
            where = items.where
            part = done.content[0].model_dump()
            yield event("response.output_text.done", text=part["text"], logprobs=[], **where)
            yield event("response.content_part.done", part=part, **where)
            index = where["output_index"]
            yield event("response.output_item.done", output_index=index, item=done.model_dump())
            kind = "response.completed" if response.status == "completed" else "response.incomplete"
            yield event(kind, response=response.model_dump())
        except Exception as exc:
            error = self.engine_error(exc)
            yield event("error", code=str(error.status), message=error.message, param=error.param)


class _StreamItems:
    """The output items one stream opens, in order: a reasoning item when the model
    reasons, then the message (which closes the reasoning). ``where`` addresses the text
    of the open one."""

    def __init__(self, event: Callable[..., str]) -> None:
        self.event = event
        self.reasoning: ResponseReasoningItem | None = None
        self.thoughts: list[str] = []
        self.message: ResponseOutputMessage | None = None
        self.where: dict[str, Any] = {}

    @property
    def thought(self) -> str | None:
        return "".join(self.thoughts) if self.reasoning is not None else None

    def reason(self, delta: str) -> list[str]:
        if not delta or self.message is not None:
            return []
        lines = []
        if self.reasoning is None:
            self.reasoning = ResponseReasoningItem()
            self.where = {"item_id": self.reasoning.id, "output_index": 0, "content_index": 0}
            item = self.reasoning.model_dump()
            lines.append(self.event("response.output_item.added", output_index=0, item=item))
        self.thoughts.append(delta)
        lines.append(self.event("response.reasoning_text.delta", delta=delta, **self.where))
        return lines

    def open_message(self) -> list[str]:
        if self.message is not None:
            return []
        lines = []
        if self.reasoning is not None:
            text = "".join(self.thoughts)
            self.reasoning.status = "completed"
            self.reasoning.content = [ResponseReasoningText(text=text)]
            lines.append(self.event("response.reasoning_text.done", text=text, **self.where))
            item = self.reasoning.model_dump()
            lines.append(self.event("response.output_item.done", output_index=0, item=item))
        self.message = ResponseOutputMessage()
        index = 0 if self.reasoning is None else 1
        self.where = {"item_id": self.message.id, "output_index": index, "content_index": 0}
        empty = ResponseOutputText(text="").model_dump()
        lines.append(
            self.event(
                "response.output_item.added", output_index=index, item=self.message.model_dump()
            )
        )
        lines.append(self.event("response.content_part.added", part=empty, **self.where))
        return lines
