"""`POST /v1/completions`: text (or token-id) prompts in, completions out, whole or streamed."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request

from kvserve.entrypoints.openai.beam_search import beam_search
from kvserve.entrypoints.openai.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    OpenAIServingError,
    UsageInfo,
    sse_data,
)
from kvserve.entrypoints.openai.serving_engine import OpenAIServing, merge_async_iterators
from kvserve.entrypoints.openai.tenants import tenant_cache_salt
from kvserve.outputs import CompletionOutput, Logprob, RequestOutput

Merged = AsyncGenerator[tuple[int, RequestOutput], None]


def _prompt_only(request: CompletionRequest) -> bool:
    """echo with max_tokens 0 (evaluation harnesses' loglikelihood shape): the prompt and its
    log-probs. The engine samples at least one token, so one is generated and dropped, as
    vLLM does."""
    return request.echo and request.max_tokens == 0


def _without_tokens(sample: CompletionOutput) -> CompletionOutput:
    """``sample`` as if it had reached max_tokens 0 (its one token dropped)."""
    finished = sample.finish_reason in ("stop", "length")
    return replace(
        sample,
        text="",
        token_ids=[],
        logprobs=None if sample.logprobs is None else [],
        finish_reason="length" if finished else sample.finish_reason,
        stop_reason=None if finished else sample.stop_reason,
    )


@dataclass
class _Prompt:
    text: str
    token_ids: list[int]


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(
        self, request: CompletionRequest, raw_request: Request | None = None
    ) -> CompletionResponse | AsyncIterator[str]:
        """A CompletionResponse, or (stream=True) an iterator of SSE lines.

        Raises OpenAIServingError for anything the client must fix, before any output.
        """
        model = self.models.resolve(request.model)
        if request.suffix:
            raise OpenAIServingError("suffix is not supported", param="suffix")
        if request.echo and request.logprobs is not None and request.stream:
            raise OpenAIServingError(
                "echo with logprobs is only supported without stream", param="echo"
            )
        prompts = await self._prompts(request.prompt)
        base_id = self.request_id(raw_request, request.request_id, "cmpl")
        generators = []
        for i, prompt in enumerate(prompts):
            max_tokens = self.check_length(
                len(prompt.token_ids), 1 if _prompt_only(request) else request.max_tokens
            )
            request_id = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            if request.use_beam_search:
                generators.append(
                    self._beam_search(request, prompt.token_ids, max_tokens, request_id)
                )
                continue
            try:
                params = request.to_sampling_params(max_tokens, self.default_sampling_params)
            except ValueError as exc:
                raise self.bad_request(exc) from None
            if request.echo and request.logprobs is not None:
                params = params.clone(prompt_logprobs=request.logprobs)
            generators.append(
                self.generate(
                    {"prompt_token_ids": prompt.token_ids, "prompt": prompt.text},
                    params,
                    request_id,
                    request.priority,
                    request.cache_salt,
                    self.models.lora_request(request.model),
                )
            )
        merged = merge_async_iterators(*generators)
        response_id = self.response_id(base_id, "cmpl")
        if not request.stream:
            return await self._full(request, merged, prompts, model, response_id)
        try:
            # Bad input surfaces here, while a 400 can still be sent instead of a stream.
            first = await anext(merged)
        except Exception as exc:
            await merged.aclose()
            raise self.engine_error(exc) from None
        return self._stream(request, merged, first, prompts, model, response_id)

    def _beam_search(
        self, request: CompletionRequest, prompt_ids: list[int], max_tokens: int, request_id: str
    ) -> AsyncGenerator[RequestOutput, None]:
        try:
            params = request.to_beam_search_params(max_tokens)
            max_logprobs = self.engine_client.model_config.max_logprobs
            if max_logprobs != -1 and 2 * params.beam_width > max_logprobs:
                raise ValueError(
                    f"n must be at most {max_logprobs // 2} with use_beam_search (each step "
                    f"asks for 2n logprobs; the server's max_logprobs is {max_logprobs})"
                )
        except ValueError as exc:
            raise self.bad_request(exc) from None
        return beam_search(
            self.engine_client,
            prompt_ids,
            params,
            request_id,
            self.max_model_len,
            request.priority,
            tenant_cache_salt(request.cache_salt),
        )

    async def _prompts(
        self, prompt: str | list[str] | list[int] | list[list[int]]
    ) -> list[_Prompt]:
        if not prompt:
            raise OpenAIServingError("prompt must not be empty", param="prompt")
        # One prompt (text or ids) or a batch of them.
        batch: list[Any] = (
            [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else list(prompt)
        )
        out: list[_Prompt] = []
        for p in batch:
            if isinstance(p, str):
                if not p:
                    raise OpenAIServingError("prompt must not be empty", param="prompt")
                out.append(_Prompt(p, await self.tokenize(p, add_special_tokens=True)))
            elif isinstance(p, list) and p and all(isinstance(t, int) for t in p):
                self.check_token_ids(p, "prompt")
                text = "" if self.tokenizer is None else self.tokenizer.decode(p)
                out.append(_Prompt(text, list(p)))
            else:
                raise OpenAIServingError(
                    "prompt must be a string, a list of strings, a list "
                    "of token ids or a list of such lists",
                    param="prompt",
                )
        return out

    async def _full(
        self,
        request: CompletionRequest,
        merged: Merged,
        prompts: list[_Prompt],
        model: str,
        response_id: str,
    ) -> CompletionResponse:
        finals: dict[int, RequestOutput] = {}
        try:
            async with contextlib.aclosing(merged):
                async for prompt_idx, output in merged:
                    self.check_output(output)
                    finals[prompt_idx] = output
        except Exception as exc:
            raise self.engine_error(exc) from None
        choices: list[CompletionResponseChoice] = []
        completion_tokens = 0
        drop = _prompt_only(request)
        for prompt_idx in sorted(finals):
            output, prompt = finals[prompt_idx], prompts[prompt_idx]
            for c in output.outputs:
                sample = _without_tokens(c) if drop else c
                completion_tokens += len(sample.token_ids)
                text = prompt.text + sample.text if request.echo else sample.text
                logprobs = None
                if request.logprobs is not None and sample.logprobs is not None:
                    ids = sample.token_ids
                    rows: list[dict[int, Logprob] | None] = list(sample.logprobs)
                    if request.echo and output.prompt_logprobs is not None:
                        ids = prompt.token_ids + ids
                        rows = list(output.prompt_logprobs) + rows
                    logprobs = self.completion_logprobs(ids, rows, 0)
                choices.append(
                    CompletionResponseChoice(
                        index=prompt_idx * request.n + c.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=sample.finish_reason,
                        stop_reason=sample.stop_reason,
                    )
                )
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        return CompletionResponse(
            id=response_id,
            model=model,
            choices=choices,
            usage=UsageInfo.of(prompt_tokens, completion_tokens),
            # One prompt's (a batch has one per prompt: the first, as vLLM does).
            kv_transfer_params=finals[min(finals)].kv_transfer_params if finals else None,
        )

    async def _stream(
        self,
        request: CompletionRequest,
        merged: Merged,
        first: tuple[int, RequestOutput],
        prompts: list[_Prompt],
        model: str,
        response_id: str,
    ) -> AsyncGenerator[str, None]:
        created = int(time.time())
        num_choices = len(prompts) * request.n
        tokens = [0] * num_choices
        text_len = [0] * num_choices  # characters sent so far, for logprobs' text_offset
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        stream_usage = (
            request.stream_options is not None and request.stream_options.continuous_usage_stats
        )
        drop = _prompt_only(request)
        try:
            async with contextlib.aclosing(merged):
                item: tuple[int, RequestOutput] | None = first
                while item is not None:
                    prompt_idx, output = item
                    self.check_output(output)
                    for c in output.outputs:
                        i = prompt_idx * request.n + c.index
                        sample = _without_tokens(c) if drop else c
                        text = sample.text
                        if request.echo and text_len[i] == 0 and tokens[i] == 0:
                            text = prompts[prompt_idx].text + text
                        logprobs = None
                        if request.logprobs is not None and sample.logprobs:
                            logprobs = self.completion_logprobs(
                                sample.token_ids, sample.logprobs, text_len[i]
                            )
                        tokens[i] += len(sample.token_ids)
                        text_len[i] += len(text)
                        if not (text or sample.finish_reason or logprobs):
                            continue  # the detokenizer is holding back a partial character
                        chunk = CompletionStreamResponse(
                            id=response_id,
                            created=created,
                            model=model,
                            choices=[
                                CompletionResponseChoice(
                                    index=i,
                                    text=text,
                                    logprobs=logprobs,
                                    finish_reason=sample.finish_reason,
                                    stop_reason=sample.stop_reason,
                                )
                            ],
                        )
                        if stream_usage:
                            chunk.usage = UsageInfo.of(prompt_tokens, sum(tokens))
                        yield sse_data(chunk)
                    item = await anext(merged, None)
            if request.include_usage:
                chunk = CompletionStreamResponse(
                    id=response_id,
                    created=created,
                    model=model,
                    choices=[],
                    usage=UsageInfo.of(prompt_tokens, sum(tokens)),
                )
                yield sse_data(chunk)
        except Exception as exc:
            # Headers are gone already: the error travels as an SSE event, as OpenAI does.
            yield sse_data(self.engine_error(exc).to_response())
        yield "data: [DONE]\n\n"
