"""The FlashAttention backend (vLLM's FLASH_ATTN), where `vllm_flash_attn` (the
`vllm-flash-attn` wheel) or `flash_attn` imports and the device is CUDA.

It shares the Triton backend's cache layout, metadata and cache-write kernel: the
metadata already is what ``flash_attn_varlen_func`` takes (``query_start_loc`` as
``cu_seqlens_q``, the block table, the sequence lengths). One varlen call per layer
covers prefill chunks and decodes; its causal mask is bottom-right aligned, which is
exactly "a query sees the keys up to its own position" for a chunk at the end of its
request. Variants FlashAttention has no form for (StreamingLLM sinks, chunked local
attention, CacheBlend's scattered queries, float32) run the Triton kernel instead, per
call, so a model mixing them stays correct.

`flash_attn` (Dao's package) reads paged KV only in pages of a multiple of 256 tokens
and takes cumulative key lengths; `vllm_flash_attn` takes any block size and the
lengths themselves (``seqused_k``).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from kvserve.attention.backends.abstract import AttentionBackend
from kvserve.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)
from kvserve.attention.ops.triton_reshape_and_cache import reshape_and_cache

# The packages, in preference order (vLLM's fork first: any block size).
FLASH_ATTN_PACKAGES = ("vllm_flash_attn", "flash_attn")
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
# Dao's flash_attn pages the KV cache in multiples of this many tokens only.
_DAO_PAGE_MULTIPLE = 256


def flash_attn_package() -> str | None:
    """The first importable FlashAttention package, or None."""
    for name in FLASH_ATTN_PACKAGES:
        if importlib.util.find_spec(name) is not None:
            return name
    return None


class _FlashVarlen:
    """``flash_attn_varlen_func`` of the installed package, imported on first use."""

    def __init__(self) -> None:
        self.package = flash_attn_package()
        self._func: Callable[..., Any] | None = None

    def func(self) -> Callable[..., Any]:
        if self._func is None:
            if self.package is None:
                raise RuntimeError(f"FLASH_ATTN needs one of {FLASH_ATTN_PACKAGES}")
            self._func = importlib.import_module(self.package).flash_attn_varlen_func
        return self._func


_VARLEN = _FlashVarlen()


class FlashAttentionImpl(TritonAttentionImpl):
    def _flash_can_run(
        self, query: torch.Tensor, kv_cache: torch.Tensor, md: TritonAttentionMetadata
    ) -> bool:
        v = self.variant()
        return (
            query.is_cuda
            and query.dtype in _FLASH_DTYPES
            and kv_cache.dtype == query.dtype
            and self.head_size % 8 == 0
            and self.head_size <= 256
            and v.num_sink_tokens == 0
            and v.attention_chunk_size is None
            and md.positions is None
            and (_VARLEN.package != "flash_attn" or kv_cache.shape[2] % _DAO_PAGE_MULTIPLE == 0)
        )

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TritonAttentionMetadata,
    ) -> torch.Tensor:
        md = attn_metadata
        if not self._flash_can_run(query, kv_cache, md):
            return super().forward(layer, query, key, value, kv_cache, md)
        n = md.num_actual_tokens
        reshape_and_cache(key, value, kv_cache, md.slot_mapping, n)
        output = torch.empty_like(query)
        if n < query.shape[0]:
            output[n:] = 0  # padding rows (a captured batch size): the CPU backend's zeros
        if n == 0 or md.num_reqs == 0:
            return output
        v = self.variant()
        # The window holds keys k > q - W: W - 1 to the left of the query, none right.
        window = (v.sliding_window - 1, 0) if v.sliding_window is not None else (-1, -1)
        seq_lens = md.seq_lens[: md.num_reqs]
        keys: dict[str, Any]
        if _VARLEN.package == "vllm_flash_attn":
            keys = {"seqused_k": seq_lens}
        else:
            cu_seqlens_k = torch.zeros_like(md.query_start_loc)
            cu_seqlens_k[1:] = torch.cumsum(seq_lens, 0, dtype=torch.int32)
            keys = {"cu_seqlens_k": cu_seqlens_k}
        out = _VARLEN.func()(
            q=query[:n],
            k=kv_cache[0],
            v=kv_cache[1],
            cu_seqlens_q=md.query_start_loc,
            max_seqlen_q=md.max_query_len,
            max_seqlen_k=md.max_seq_len,
            softmax_scale=v.scale,
            causal=v.causal,
            window_size=window,
            softcap=float(v.logits_soft_cap or 0.0),
            block_table=md.block_table[: md.num_reqs],
            **keys,
        )
        output[:n] = out
        return output


class FlashAttentionMetadataBuilder(TritonAttentionMetadataBuilder):
    pass  # the Triton metadata is the varlen call's arguments already


class FlashAttentionBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"

    get_kv_cache_shape = staticmethod(TritonAttentionBackend.get_kv_cache_shape)

    @staticmethod
    def get_builder_cls() -> type[FlashAttentionMetadataBuilder]:
        return FlashAttentionMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[FlashAttentionImpl]:
        return FlashAttentionImpl
