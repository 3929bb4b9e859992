"""`POST /v1/embeddings`: texts or token ids in, one pooled vector per input out."""

from __future__ import annotations

import base64
import contextlib
from typing import Any

import numpy as np
from fastapi import Request

from kvserve.entrypoints.openai.embedding_protocol import (
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
)
from kvserve.entrypoints.openai.protocol import OpenAIServingError, UsageInfo
from kvserve.entrypoints.openai.serving_engine import OpenAIServing, merge_async_iterators
from kvserve.outputs import PoolingRequestOutput

_INPUT_FORMS = "a string, a list of strings, a list of token ids or a list of such lists"


class OpenAIServingEmbedding(OpenAIServing):
    async def create_embedding(
        self, request: EmbeddingRequest, raw_request: Request | None = None
    ) -> EmbeddingResponse:
        """Raises OpenAIServingError (400 for bad input, 404 for an unknown model)."""
        model = self.models.resolve(request.model)
        lora_request = self.models.lora_request(request.model)
        inputs = await self._inputs(request)
        try:
            params = request.to_pooling_params()
        except ValueError as exc:
            raise self.bad_request(exc) from None
        base_id = self.request_id(raw_request, request.request_id, "embd")
        generators = [
            self.engine_client.encode(
                {"prompt_token_ids": ids},
                params,
                base_id if len(inputs) == 1 else f"{base_id}-{i}",
                lora_request=lora_request,
            )
            for i, ids in enumerate(inputs)
        ]
        vectors: dict[int, PoolingRequestOutput] = {}
        try:
            async with contextlib.aclosing(merge_async_iterators(*generators)) as merged:
                async for index, output in merged:
                    vectors[index] = output
        except Exception as exc:
            raise self.engine_error(exc) from None
        data = [
            EmbeddingResponseData(
                index=i, embedding=_encode(vectors[i].outputs.data.numpy(), request)
            )
            for i in range(len(inputs))
        ]
        num_tokens = sum(len(ids) for ids in inputs)
        return EmbeddingResponse(
            id=self.response_id(base_id, "embd"),
            model=model,
            data=data,
            usage=UsageInfo.of(num_tokens, 0),
        )

    async def _inputs(self, request: EmbeddingRequest) -> list[list[int]]:
        value: Any = request.input
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            value = [value]
        if not value:
            raise OpenAIServingError("input must not be empty", param="input")
        inputs: list[list[int]] = []
        for item in value:
            if isinstance(item, str) and item:
                inputs.append(await self.tokenize(item, request.add_special_tokens))
            elif isinstance(item, list) and item and all(isinstance(t, int) for t in item):
                self.check_token_ids(item, "input")
                inputs.append(list(item))
            else:
                raise OpenAIServingError(f"input must be {_INPUT_FORMS}, none empty", param="input")
        for ids in inputs:
            if len(ids) > self.max_model_len:
                raise OpenAIServingError(
                    f"This model's maximum context length is {self.max_model_len} tokens. "
                    f"However, an input has {len(ids)} tokens. Please reduce its length.",
                    param="input",
                )
        return inputs


def _encode(vector: np.ndarray, request: EmbeddingRequest) -> list[float] | str:
    if request.encoding_format == "float":
        return vector.tolist()  # type: ignore[no-any-return]
    # What the openai client decodes: little-endian float32 bytes, base64.
    return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
