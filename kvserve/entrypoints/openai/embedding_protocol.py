"""`/v1/embeddings` request and response bodies (OpenAI's shape, vLLM's extra fields)."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import Field

from kvserve.entrypoints.openai.protocol import (
    OpenAIBaseModel,
    OpenAIRequestModel,
    ShortString,
    UsageInfo,
)
from kvserve.pooling_params import PoolingParams

# Inputs per request: each is a request in the engine's batch.
MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(OpenAIRequestModel):
    model: ShortString | None = None
    # A text, a batch of texts, one token-id list or a batch of them (OpenAI's forms).
    input: (
        str
        | Annotated[list[str], Field(max_length=MAX_EMBEDDING_INPUTS)]
        | list[int]
        | Annotated[list[list[int]], Field(max_length=MAX_EMBEDDING_INPUTS)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    # vLLM's extras.
    normalize: bool | None = None
    add_special_tokens: bool = True
    request_id: ShortString | None = None

    def to_pooling_params(self) -> PoolingParams:
        return PoolingParams(task="embed", normalize=self.normalize, dimensions=self.dimensions)


class EmbeddingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    # float: the values; base64: their little-endian float32 bytes.
    embedding: list[float] | str


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingResponseData]
    usage: UsageInfo
