"""OpenAIServing: what completions and chat share — model check, prompt lengths, request ids,
running generators concurrently, and the logprob shapes of both endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, TypeVar

import msgspec
from fastapi import Request

from kvserve.distributed.kv_transfer.kv_connector.base import KV_LOAD_FAILURE_PREFIX
from kvserve.engine.engine_client import EngineClient
from kvserve.engine.exceptions import EngineDeadError, EngineSleepingError
from kvserve.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    CompletionLogProbs,
    CompletionRequest,
    OpenAIServingError,
    random_uuid,
)
from kvserve.entrypoints.openai.serving_models import OpenAIServingModels
from kvserve.entrypoints.openai.tenants import counted, current_tenant, tenant_cache_salt
from kvserve.inputs import TokensPrompt
from kvserve.lora.request import LoRARequest
from kvserve.outputs import Logprob, RequestOutput
from kvserve.protocol.engine_core import ENGINE_CORE_DIED_PREFIX
from kvserve.sampling_params import SamplingParams

T = TypeVar("T")
logger = logging.getLogger(__name__)

INTERNAL_ERROR_MESSAGE = "The server had an error while processing your request (see its log)."
# SamplingParams' and the input processor's messages start with the field they reject.
_LEADING_FIELD = re.compile(r"([a-z_]+)\b")
_REQUEST_FIELDS = {
    *SamplingParams.__struct_fields__,
    *ChatCompletionRequest.model_fields,
    *CompletionRequest.model_fields,
}

# A chat turn's text tokenizes in ~0.1 ms; handing it to a thread and back costs more (the
# wake-up, then the event loop and the worker contending for the GIL), and the one-user
# chat's first token paid that. Only long prompts, which would stall other streams, go to
# a thread.
INLINE_TOKENIZE_CHARS = 4096


class OpenAIServing:
    def __init__(self, engine_client: EngineClient, models: OpenAIServingModels) -> None:
        self.engine_client = engine_client
        self.models = models
        self.tokenizer = engine_client.tokenizer
        assert engine_client.model_config.max_model_len is not None
        self.max_model_len: int = engine_client.model_config.max_model_len
        # The model's generation config: defaults for what a request leaves out, and its
        # max_new_tokens a server-wide cap on output length (vLLM's behaviour).
        self.default_sampling_params = engine_client.model_config.get_diff_sampling_param()
        self.log_requests = True

    @staticmethod
    def request_id(raw_request: Request | None, body_id: str | None, prefix: str) -> str:
        """The client's X-Request-Id (or body `request_id`) when given, else a fresh one."""
        header = raw_request.headers.get("x-request-id") if raw_request is not None else None
        return header or body_id or f"{prefix}-{random_uuid()}"

    @staticmethod
    def response_id(request_id: str, prefix: str) -> str:
        return request_id if request_id.startswith(f"{prefix}-") else f"{prefix}-{request_id}"

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.tokenizer is None:
            raise OpenAIServingError(
                "the server runs without a tokenizer (--skip-tokenizer-init): send token ids",
                param="prompt",
            )

        def encode() -> list[int]:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

        if len(text) <= INLINE_TOKENIZE_CHARS:
            return encode()
        # Fast tokenizers release the GIL: a long prompt does not stall other requests.
        return await asyncio.to_thread(encode)

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        """A 400 naming ``param`` for ids outside the vocabulary (before anything decodes them)."""
        vocab_size = self.engine_client.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise OpenAIServingError(
                f"{param} contains token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
                param=param,
            )

    def check_length(
        self, prompt_len: int, max_tokens: int | None, input_param: str = "prompt"
    ) -> int:
        """The max_tokens to run with; raises a 400 when the request cannot fit the context."""
        limit = self.max_model_len
        if prompt_len >= limit:
            raise OpenAIServingError(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"request has {prompt_len} input tokens. Please reduce the length of the "
                "input.",
                param=input_param,
            )
        cap = self.default_sampling_params.get("max_tokens")
        if max_tokens is None:
            return min(limit - prompt_len, cap or limit)
        if max_tokens < 1:
            raise OpenAIServingError(
                f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens"
            )
        if prompt_len + max_tokens > limit:
            raise OpenAIServingError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the input, "
                f"{max_tokens} in the completion). Please reduce the length of the input "
                "or of the completion.",
                param="max_tokens",
            )
        return min(max_tokens, cap or max_tokens)

    def generate(
        self,
        prompt: TokensPrompt,
        params: SamplingParams,
        request_id: str,
        priority: int,
        cache_salt: str | None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        if self.log_requests:
            # msgspec leaves defaults out: the line shows what this request changed.
            logger.info(
                "request %s: %d prompt tokens, params %s",
                request_id,
                len(prompt["prompt_token_ids"]),
                msgspec.json.encode(params).decode(),
            )
        outputs = self.engine_client.generate(
            prompt,
            params,
            request_id,
            priority=priority,
            cache_salt=tenant_cache_salt(cache_salt),
            lora_request=lora_request,
        )
        tenant = current_tenant.get()
        return outputs if tenant is None else counted(outputs, tenant)

    @staticmethod
    def engine_error(exc: BaseException) -> OpenAIServingError:
        """The HTTP error for a failure inside generation (bad input -> 400, engine -> 5xx)."""
        if isinstance(exc, OpenAIServingError):
            return exc
        if isinstance(exc, ValueError):
            return OpenAIServing.bad_request(exc)
        if isinstance(exc, (EngineDeadError, EngineSleepingError)):
            return OpenAIServingError(str(exc), status=503)
        # The server's own failure: logged with its traceback, the client gets no internals.
        logger.error("request failed inside the server", exc_info=exc)
        return OpenAIServingError(INTERNAL_ERROR_MESSAGE, status=500)

    @staticmethod
    def bad_request(exc: ValueError) -> OpenAIServingError:
        """A 400 for a validation error; ``param`` is the field its message starts with."""
        message = str(exc)
        match = _LEADING_FIELD.match(message)
        param = match.group(1) if match else None
        if param not in _REQUEST_FIELDS:
            param = None
        return OpenAIServingError(message, param=param)

    @staticmethod
    def check_output(output: RequestOutput) -> None:
        """A sample the engine failed (finish_reason "error") becomes a 500."""
        if output.error and output.error.startswith(KV_LOAD_FAILURE_PREFIX):
            # Disaggregated serving: the KV never came (kv_load_failure_policy "fail").
            # The client (a proxy) may retry; the message says what happened.
            raise OpenAIServingError(output.error, status=503)
        if output.error and output.error.startswith(ENGINE_CORE_DIED_PREFIX):
            # Data parallelism with --data-parallel-tolerate-failure: this request's core
            # died, the others serve on; a retry goes to a live one.
            raise OpenAIServingError(output.error, status=503)
        if output.error:
            # The engine isolated this request's failure (the others go on); the details
            # are in the server log, not for the client.
            logger.error("request %s failed in the engine: %s", output.request_id, output.error)
            raise OpenAIServingError(INTERNAL_ERROR_MESSAGE, status=500)

    # ----------------------------------------------------------------- logprob shapes

    def decoded(self, token_id: int, lp: Logprob | None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return "" if self.tokenizer is None else self.tokenizer.decode([token_id])

    def completion_logprobs(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[dict[int, Logprob] | None],
        text_offset: int,
    ) -> CompletionLogProbs:
        """`{tokens, token_logprobs, top_logprobs, text_offset}`; offsets start at text_offset."""
        out = CompletionLogProbs()
        offset = text_offset
        for tid, row in zip(token_ids, logprobs, strict=True):
            token = self.decoded(tid, row.get(tid) if row else None)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            if row is None:  # the first prompt token (echo): nothing predicts it
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(max(row[tid].logprob, -9999.0) if tid in row else None)
            out.top_logprobs.append(
                {self.decoded(t, lp): max(lp.logprob, -9999.0) for t, lp in row.items()}
            )
        return out

    def chat_logprobs(
        self, token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]], top_logprobs: int
    ) -> ChatCompletionLogProbs:
        content: list[ChatCompletionLogProbsContent] = []
        for tid, row in zip(token_ids, logprobs, strict=True):
            token = self.decoded(tid, row.get(tid))
            top = sorted(
                (
                    item
                    for item in row.items()
                    if item[1].rank is not None and 1 <= item[1].rank <= top_logprobs
                ),
                key=lambda item: item[1].rank or 0,
            )
            content.append(
                ChatCompletionLogProbsContent(
                    token=token,
                    logprob=max(row[tid].logprob, -9999.0) if tid in row else -9999.0,
                    bytes=list(token.encode("utf-8")),
                    top_logprobs=[self._chat_logprob(t, lp) for t, lp in top],
                )
            )
        return ChatCompletionLogProbs(content=content)

    def _chat_logprob(self, token_id: int, lp: Logprob) -> ChatCompletionLogProb:
        # -inf is not valid JSON; OpenAI clamps to -9999 the same way.
        text = self.decoded(token_id, lp)
        return ChatCompletionLogProb(
            token=text, logprob=max(lp.logprob, -9999.0), bytes=list(text.encode("utf-8"))
        )


async def merge_async_iterators(
    *iterators: AsyncIterator[T],
) -> AsyncGenerator[tuple[int, T], None]:
    """Yields (index, item) from several iterators as items arrive.

    Closing (or cancelling) the merged iterator cancels every source, which is how the
    engine hears that the client went away: each generate() aborts its request on
    cancellation.
    """
    if len(iterators) == 1:
        async with contextlib.aclosing(iterators[0]) as only:  # type: ignore[type-var]
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    done = object()

    async def drain(index: int, iterator: AsyncIterator[T]) -> None:
        try:
            async for item in iterator:
                queue.put_nowait((index, item, None))
            queue.put_nowait((index, done, None))
        except Exception as exc:
            queue.put_nowait((index, None, exc))

    tasks = [asyncio.create_task(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is done:
                remaining -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
