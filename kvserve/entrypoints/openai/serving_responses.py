"""`POST /v1/responses`: OpenAI's Responses API over the chat template, whole or streamed.

Input is text or a list of items (responses_input: messages, function calls and their
outputs), rendered as chat messages; ``instructions`` become a system message placed first.
Output is an assistant message and/or function calls (responses_tools: function tools,
tool_choice, parallel_tool_calls, as on the chat path), after a reasoning item where the
server has a reasoning parser and the model reasoned.
Responses are kept (for ``GET /v1/responses/{id}`` and ``previous_response_id``) only when
the server runs with ``--enable-store-responses``, in memory and bounded.
"""

from __future__ import annotations

import contextlib
import json
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request

from kvserve.entrypoints.openai.protocol import OpenAIServingError
from kvserve.entrypoints.openai.protocol_responses import (
    IncompleteDetails,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
)
from kvserve.entrypoints.openai.responses_input import input_messages
from kvserve.entrypoints.openai.responses_tools import OutputItemStreamer, ResponsesTools
from kvserve.entrypoints.openai.serving_chat import OpenAIServingChat
from kvserve.entrypoints.openai.serving_chat_reasoning import ChatReasoningHandler
from kvserve.entrypoints.openai.serving_engine import OpenAIServing
from kvserve.outputs import RequestOutput

# Stored responses kept at most (oldest dropped first), with their conversations.
MAX_STORED_RESPONSES = 1024


class OpenAIServingResponses(OpenAIServing):
    def __init__(self, chat: OpenAIServingChat, enable_store: bool = False) -> None:
        super().__init__(chat.engine_client, chat.models)
        self.chat = chat
        self.enable_store = enable_store
        # id -> (response, the conversation it answered, without instructions).
        self.store: OrderedDict[str, tuple[ResponsesResponse, list[dict[str, Any]]]] = OrderedDict()

    def retrieve(self, response_id: str) -> ResponsesResponse:
        if response_id not in self.store:
            raise OpenAIServingError(f"Response with id {response_id!r} not found.", status=404)
        return self.store[response_id][0]

    def _history(self, request: ResponsesRequest) -> list[dict[str, Any]]:
        if request.previous_response_id is None:
            return []
        if not self.enable_store:
            raise OpenAIServingError(
                "previous_response_id needs a server started with --enable-store-responses",
                param="previous_response_id",
            )
        previous = self.retrieve(request.previous_response_id)
        _, conversation = self.store[previous.id]
        return [*conversation, *input_messages([i.model_dump() for i in previous.output])]

    async def create_response(
        self, request: ResponsesRequest, raw_request: Request | None = None
    ) -> ResponsesResponse | AsyncIterator[str]:
        """A ResponsesResponse, or (stream=True) an iterator of SSE events."""
        model = self.models.resolve(request.model)
        tools = ResponsesTools(request, self.chat)
        conversation = [*self._history(request), *input_messages(request.input)]
        system = (
            [{"role": "system", "content": request.instructions}] if request.instructions else []
        )
        try:
            text, prompt_ids = await self.chat.render_prompt(
                [*system, *conversation],
                True,
                False,
                None,
                tools.template_tools or None,
            )
        except OpenAIServingError as exc:
            exc.param = "input"  # the messages rendered are this request's input
            raise
        max_tokens = self.check_length(len(prompt_ids), request.max_output_tokens, "input")
        reasoning = ChatReasoningHandler(self.chat.reasoning_parser, text, include=True)
        try:
            params = request.to_sampling_params(max_tokens, self.default_sampling_params)
            params = reasoning.sampling_params(tools.handler.sampling_params(params))
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
            tools=request.tools or [],
            tool_choice=request.tool_choice or ("auto" if request.tools else "none"),
            parallel_tool_calls=request.parallel_tool_calls is not False,
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
            self._finish(response, final, len(prompt_ids), len(sample.token_ids), conversation)
            thought, content = reasoning.split(sample.text)
            incomplete = response.status == "incomplete"
            response.output = [
                *tools.reasoning_items(thought, incomplete),
                *tools.output_items(content, incomplete),
            ]
            return response
        try:
            first = await anext(outputs)
        except Exception as exc:
            await outputs.aclose()
            raise self.engine_error(exc) from None
        items = tools.streamer(reasoning)
        return self._stream(response, outputs, first, len(prompt_ids), conversation, items)

    def _finish(
        self,
        response: ResponsesResponse,
        final: RequestOutput,
        prompt_tokens: int,
        output_tokens: int,
        conversation: list[dict[str, Any]],
    ) -> None:
        """Completes ``response``'s status and usage from the last output (stores it if
        asked: the caller sets its output items)."""
        sample = final.outputs[0]
        incomplete = sample.finish_reason == "length"
        response.status = "incomplete" if incomplete else "completed"
        if incomplete:
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        response.usage = ResponseUsage.of(
            prompt_tokens, output_tokens, final.num_cached_tokens or 0
        )
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
        conversation: list[dict[str, Any]],
        items: OutputItemStreamer,
    ) -> AsyncGenerator[str, None]:
        sequence = 0

        def event(kind: str, **body: Any) -> str:
            nonlocal sequence
            data = {"type": kind, "sequence_number": sequence, **body}
            sequence += 1
            return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

        yield event("response.created", response=response.model_dump())
        yield event("response.in_progress", response=response.model_dump())
        for kind, body in items.start():
            yield event(kind, **body)
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
                    for kind, body in items.feed(sample.text, sample.finish_reason is not None):
                        yield event(kind, **body)
                    output = await anext(outputs, None)
            self._finish(response, final, prompt_tokens, output_tokens, conversation)
            done, output_items = items.finish(response.status == "incomplete")
            response.output = output_items
            for kind, body in done:
                yield event(kind, **body)
            kind = "response.completed" if response.status == "completed" else "response.incomplete"
            yield event(kind, response=response.model_dump())
        except Exception as exc:
            error = self.engine_error(exc)
            yield event("error", code=str(error.status), message=error.message, param=error.param)
