"""kvserve: a small, typed LLM inference and serving engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from kvserve.entrypoints.llm import LLM
    from kvserve.model_executor.models.registry import ModelRegistry
    from kvserve.outputs import (
        CompletionOutput,
        EmbeddingRequestOutput,
        PoolingRequestOutput,
        RequestOutput,
        ScoringRequestOutput,
    )
    from kvserve.pooling_params import PoolingParams
    from kvserve.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "ModelRegistry",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "ScoringRequestOutput",
]

_LAZY = {
    "LLM": "kvserve.entrypoints.llm",
    "CompletionOutput": "kvserve.outputs",
    "ModelRegistry": "kvserve.model_executor.models.registry",
    "RequestOutput": "kvserve.outputs",
    "EmbeddingRequestOutput": "kvserve.outputs",
    "PoolingRequestOutput": "kvserve.outputs",
    "ScoringRequestOutput": "kvserve.outputs",
    "PoolingParams": "kvserve.pooling_params",
    "RequestOutputKind": "kvserve.sampling_params",
    "SamplingParams": "kvserve.sampling_params",
}


def __getattr__(name: str) -> Any:
    # Lazy, so `import kvserve.config` in a worker does not pull in the whole engine.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
