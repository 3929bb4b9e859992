"""`POST /v1/chat/completions`: messages through the chat template, replies whole or streamed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request
from jinja2 import TemplateError

from kvserve.engine.chat_media import extract_chat_images, has_image_parts, media_policy
from kvserve.engine.engine_client import EngineClient
from kvserve.engine.input_processor import apply_chat_template
from kvserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    OpenAIServingError,
    UsageInfo,
    sse_data,
)
from kvserve.entrypoints.openai.reasoning_parsers import ReasoningParser, make_reasoning_parser
from kvserve.entrypoints.openai.serving_chat_messages import messages_for_template
from kvserve.entrypoints.openai.serving_chat_reasoning import (
    ChatReasoningHandler,
    ChoiceReasoningStreamer,
)
from kvserve.entrypoints.openai.serving_chat_tools import ChatToolHandler, ChoiceToolStreamer
from kvserve.entrypoints.openai.serving_engine import OpenAIServing, merge_async_iterators
from kvserve.entrypoints.openai.serving_models import OpenAIServingModels
from kvserve.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager
from kvserve.entrypoints.openai.tool_parsers.auto_select import (
    resolve_tool_parser,
    template_supports_tools,
)
from kvserve.outputs import RequestOutput

Merged = AsyncGenerator[tuple[int, RequestOutput], None]
logger = logging.getLogger(__name__)


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self,
        engine_client: EngineClient,
        models: OpenAIServingModels,
        chat_template: str | None = None,
        response_role: str = "assistant",
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        """``tool_call_parser``: a parser's name, or "auto"/None to pick one from the
        template (tool_choice "auto" is always available, as vLLM's
        --enable-auto-tool-choice makes it)."""
        super().__init__(engine_client, models)
        self.chat_template = chat_template
        self.response_role = response_role
        choice = resolve_tool_parser(tool_call_parser, self._template(None), self.tokenizer)
        logger.info("tool call parser: %s (%s)", choice.name, choice.reason)
        self.tool_parser: ToolParser = ToolParserManager.get_tool_parser(choice.name)(
            self.tokenizer
        )
        self.reasoning_parser: ReasoningParser | None = make_reasoning_parser(
            reasoning_parser, self.tokenizer, chat_template
        )

    def _template(self, chat_template: str | None) -> Any:
        """The template that renders: the request's, the server's, or the tokenizer's."""
        if chat_template or self.chat_template:
            return chat_template or self.chat_template
        return self.tokenizer.chat_template if self.tokenizer is not None else None

    async def render_prompt(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template: str | None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[str, list[int]]:
        """The templated prompt text and its token ids (the template holds BOS already).

        Tool turns are normalised first (serving_chat_messages.py), so every endpoint that
        renders chat messages here takes agents' tool round trips on any template."""
        try:
            messages, tools = messages_for_template(
                messages, tools, template_supports_tools(self._template(chat_template))
            )
            text = apply_chat_template(
                self.tokenizer,
                messages,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template or self.chat_template,
                tools=tools,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
            )
        except ValueError as exc:
            raise OpenAIServingError(str(exc), param="messages") from None
        except (TypeError, TemplateError) as exc:
            # The template met content of a shape it does not handle (e.g. a list of
            # parts where it concatenates strings): the request's messages, not a fault.
            raise OpenAIServingError(
                f"the chat template cannot render these messages: {type(exc).__name__}: {exc}",
                param="messages",
            ) from None
        return text, await self.tokenize(text, add_special_tokens=False)

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request | None = None
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        """A ChatCompletionResponse, or (stream=True) an iterator of SSE lines."""
        model = self.models.resolve(request.model)
        tools = ChatToolHandler(request, self.tool_parser)
        add_generation_prompt = request.add_generation_prompt and not request.continue_final_message
        messages = request.messages
        images: list[object] = []
        if has_image_parts(messages):
            if self.engine_client.model_config.arch.multimodal is None:
                architecture = self.engine_client.model_config.arch.architecture
                raise OpenAIServingError(
                    f"{architecture} is a text-only model: image_url parts are not supported",
                    param="messages",
                )
            # Loading and decoding run off the event loop; a bad image is the client's 400.
            policy = media_policy(self.engine_client.config.multimodal_config)
            try:
                messages, images = await asyncio.to_thread(extract_chat_images, messages, policy)
            except ValueError as exc:
                raise OpenAIServingError(str(exc), param="messages") from None
        text, prompt_ids = await self.render_prompt(
            messages,
            add_generation_prompt,
            request.continue_final_message,
            request.chat_template,
            [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None,
            request.chat_template_kwargs,
        )
        reasoning = ChatReasoningHandler(self.reasoning_parser, text, request.include_reasoning)
        max_tokens = self.check_length(len(prompt_ids), request.requested_max_tokens(), "messages")
        try:
            params = request.to_sampling_params(max_tokens, self.default_sampling_params)
            params = reasoning.sampling_params(tools.sampling_params(params))
        except ValueError as exc:
            raise self.bad_request(exc) from None
        base_id = self.request_id(raw_request, request.request_id, "chatcmpl")
        prompt: Any = {"prompt_token_ids": prompt_ids, "prompt": text}
        if images:  # the engine expands the image markers (and counts the tokens again)
            prompt = {"prompt": text, "multi_modal_data": {"image": images}}
            prompt["add_special_tokens"] = False
        merged = merge_async_iterators(
            self.generate(
                prompt,
                params,
                base_id,
                request.priority,
                request.cache_salt,
                self.models.lora_request(request.model),
            )
        )
        response_id = self.response_id(base_id, "chatcmpl")
        if not request.stream:
            return await self._full(
                request, merged, len(prompt_ids), model, response_id, tools, reasoning
            )
        try:
            first = await anext(merged)
        except Exception as exc:
            await merged.aclose()
            raise self.engine_error(exc) from None
        # The engine's prompt (with images, their expanded placeholders) is the one counted.
        num_prompt = len(first[1].prompt_token_ids or prompt_ids)
        return self._stream(
            request, merged, first, num_prompt, model, response_id, tools, reasoning
        )

    async def _full(
        self,
        request: ChatCompletionRequest,
        merged: Merged,
        prompt_tokens: int,
        model: str,
        response_id: str,
        tools: ChatToolHandler,
        reasoning: ChatReasoningHandler,
    ) -> ChatCompletionResponse:
        final: RequestOutput | None = None
        try:
            async with contextlib.aclosing(merged):
                async for _, output in merged:
                    self.check_output(output)
                    final = output
        except Exception as exc:
            raise self.engine_error(exc) from None
        assert final is not None
        choices: list[ChatCompletionResponseChoice] = []
        for c in final.outputs:
            logprobs = None
            if request.logprobs and c.logprobs is not None:
                logprobs = self.chat_logprobs(c.token_ids, c.logprobs, request.top_logprobs or 0)
            thought, text = reasoning.split(c.text)
            content, tool_calls = tools.parse(text) if tools.parses_output else (text, [])
            choices.append(
                ChatCompletionResponseChoice(
                    index=c.index,
                    message=ChatMessage(
                        role=self.response_role,
                        content=content if thought is None else content or None,
                        reasoning_content=thought,
                        reasoning=thought,
                        tool_calls=tool_calls,
                    ),
                    logprobs=logprobs,
                    finish_reason=tools.finish_reason(c.finish_reason, bool(tool_calls)),
                    stop_reason=c.stop_reason,
                )
            )
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        return ChatCompletionResponse(
            id=response_id,
            model=model,
            choices=choices,
            usage=UsageInfo.of(
                len(final.prompt_token_ids or []) or prompt_tokens, completion_tokens
            ),
            kv_transfer_params=final.kv_transfer_params,
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        merged: Merged,
        first: tuple[int, RequestOutput],
        prompt_tokens: int,
        model: str,
        response_id: str,
        tools: ChatToolHandler,
        reasoning: ChatReasoningHandler,
    ) -> AsyncGenerator[str, None]:
        created = int(time.time())
        tokens = [0] * request.n
        streamers: list[ChoiceToolStreamer | None] = [
            tools.streamer() if tools.parses_output else None for _ in range(request.n)
        ]
        thinkers: list[ChoiceReasoningStreamer] = [reasoning.streamer() for _ in range(request.n)]
        stream_usage = (
            request.stream_options is not None and request.stream_options.continuous_usage_stats
        )

        def chunk(
            choices: list[ChatCompletionResponseStreamChoice], usage: UsageInfo | None = None
        ) -> str:
            body = ChatCompletionStreamResponse(
                id=response_id, created=created, model=model, choices=choices, usage=usage
            )
            return sse_data(body)

        try:
            # OpenAI's first chunk per choice names the role and carries no text.
            for i in range(request.n):
                yield chunk(
                    [
                        ChatCompletionResponseStreamChoice(
                            index=i, delta=DeltaMessage(role=self.response_role, content="")
                        )
                    ]
                )
            async with contextlib.aclosing(merged):
                item: tuple[int, RequestOutput] | None = first
                while item is not None:
                    output = item[1]
                    self.check_output(output)
                    for c in output.outputs:
                        tokens[c.index] += len(c.token_ids)
                        logprobs = None
                        if request.logprobs and c.logprobs:
                            logprobs = self.chat_logprobs(
                                c.token_ids, c.logprobs, request.top_logprobs or 0
                            )
                        finished = c.finish_reason is not None
                        # The reasoning first: tool calls are read from the content only.
                        thought, text = thinkers[c.index].feed(c.text, finished)
                        delta = DeltaMessage(content=None if thought and not text else text)
                        finish_reason = c.finish_reason
                        streamer = streamers[c.index]
                        if streamer is not None:
                            content, calls = streamer.feed(text, finished)
                            delta = DeltaMessage(content=content or None, tool_calls=calls or None)
                            finish_reason = tools.finish_reason(
                                finish_reason, streamer.tools_called
                            )
                        if thought:
                            delta.reasoning_content = delta.reasoning = thought
                        if not (
                            delta.content
                            or thought
                            or delta.tool_calls
                            or finish_reason
                            or logprobs
                        ):
                            continue
                        usage = UsageInfo.of(prompt_tokens, sum(tokens)) if stream_usage else None
                        yield chunk(
                            [
                                ChatCompletionResponseStreamChoice(
                                    index=c.index,
                                    delta=delta,
                                    logprobs=logprobs,
                                    finish_reason=finish_reason,
                                    stop_reason=c.stop_reason,
                                )
                            ],
                            usage,
                        )
                    item = await anext(merged, None)
            if request.include_usage:
                yield chunk([], UsageInfo.of(prompt_tokens, sum(tokens)))
        except Exception as exc:
            yield sse_data(self.engine_error(exc).to_response())
        yield "data: [DONE]\n\n"
