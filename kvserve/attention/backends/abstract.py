"""The three roles of an attention backend: shape of the cache, per-step metadata
builder, per-layer implementation. The model runner only talks to these ABCs."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from kvserve.attention.backends.utils import CommonAttentionMetadata


class AttentionMetadataBuilder(ABC):
    """Turns ``CommonAttentionMetadata`` into the backend's own metadata, once per
    step; every layer of the model then reuses the result."""

    # Whether build() only forwards device tensors and host ints fixed by the batch's
    # shape, so a captured CUDA graph stays right when it replays with new values in the
    # same buffers (vLLM's AttentionCGSupport; worker/cuda_graph_runner.py).
    cudagraph_support: bool = False

    def __init__(self, block_size: int, device: torch.device | str) -> None:
        self.block_size = block_size
        self.device = torch.device(device)

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> Any: ...


class AttentionImpl(ABC):
    """Per-layer attention math over the paged KV cache."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        attention_chunk_size: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads={num_heads} not divisible by num_kv_heads={num_kv_heads}")
        for name, value in (
            ("sliding_window", sliding_window),
            ("attention_chunk_size", attention_chunk_size),
            ("logits_soft_cap", logits_soft_cap),
        ):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive or None, got {value}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        # Which keys a query sees (``attention.backends.utils.visible_keys``).
        self.sliding_window = sliding_window
        self.attention_chunk_size = attention_chunk_size
        # StreamingLLM sink mode sets this on layers with a sliding window: the first
        # num_sink_tokens keys stay visible whatever the window.
        self.num_sink_tokens = 0
        # Scores become ``cap * tanh(scores / cap)`` before the mask (Gemma 2 style).
        self.logits_soft_cap = logits_soft_cap
        # False for encoder-only layers: every query sees every key of its prompt.
        self.causal = True

    @abstractmethod
    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> torch.Tensor:
        """``query [T, num_heads, head_size]``, ``key/value [T, num_kv_heads,
        head_size]``; writes K/V into ``kv_cache`` and returns ``[T, num_heads,
        head_size]``."""


class AttentionBackend(ABC):
    """Static description of a backend; never instantiated."""

    @staticmethod
    @abstractmethod
    def get_name() -> str: ...

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]: ...

    @staticmethod
    @abstractmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]: ...

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]: ...
