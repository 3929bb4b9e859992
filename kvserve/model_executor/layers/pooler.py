"""Poolers: one vector per prompt from the model's final hidden states.

A prompt may reach the runner in several chunks (chunked prefill), so a pooling method
folds chunks into a running state and reads the vector off it at the prompt's end:
``LAST`` keeps the last token's state, ``CLS`` the first token's, ``MEAN`` a running sum
and count. Methods are registered by vLLM's PoolingType names.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvserve.pooling_params import PoolerConfig, PoolingParams


class PoolingMethod(ABC):
    registry: ClassVar[dict[str, type[PoolingMethod]]] = {}
    name: ClassVar[str]

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        PoolingMethod.registry[cls.name] = cls

    @abstractmethod
    def fold(self, state: torch.Tensor | None, chunk: torch.Tensor, start: int) -> torch.Tensor:
        """The state after ``chunk`` (``[n, hidden]``, prompt positions ``start..start+n``)."""

    def finish(self, state: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The pooled vector of a prompt of ``num_tokens`` tokens."""
        return state


class LastPool(PoolingMethod):
    name = "LAST"

    def fold(self, state: torch.Tensor | None, chunk: torch.Tensor, start: int) -> torch.Tensor:
        return chunk[-1]


class CLSPool(PoolingMethod):
    name = "CLS"

    def fold(self, state: torch.Tensor | None, chunk: torch.Tensor, start: int) -> torch.Tensor:
        if start == 0:
            return chunk[0]
        assert state is not None, "the first chunk of a prompt starts at position 0"
        return state


class MeanPool(PoolingMethod):
    name = "MEAN"

    def fold(self, state: torch.Tensor | None, chunk: torch.Tensor, start: int) -> torch.Tensor:
        # float64 sums: a long prompt's mean does not drift with the chunking.
        chunk_sum = chunk.sum(dim=0, dtype=torch.float64)
        return chunk_sum if start == 0 or state is None else state + chunk_sum

    def finish(self, state: torch.Tensor, num_tokens: int) -> torch.Tensor:
        return (state / num_tokens).to(torch.float32)


class Pooler:
    """The model's pooling method plus the per-request normalisation and truncation."""

    def __init__(self, config: PoolerConfig) -> None:
        assert config.pooling_type is not None, "resolved by ModelConfig"
        self.config = config
        self.method = PoolingMethod.registry[config.pooling_type]()

    def fold(self, state: torch.Tensor | None, chunk: torch.Tensor, start: int) -> torch.Tensor:
        return self.method.fold(state, chunk, start)

    def finish(
        self, state: torch.Tensor, num_tokens: int, params: PoolingParams | None
    ) -> list[float]:
        vector = self.method.finish(state, num_tokens).float()
        if params is not None and params.dimensions is not None:
            vector = vector[: params.dimensions]
        normalize = self.config.normalize
        if params is not None and params.normalize is not None:
            normalize = params.normalize
        if normalize:
            vector = F.normalize(vector, p=2, dim=-1)
        return vector.cpu().tolist()
