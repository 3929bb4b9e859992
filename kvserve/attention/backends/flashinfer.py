"""The FlashInfer backend (vLLM's FLASHINFER), where `flashinfer` (the
`flashinfer-python` wheel) imports and the device is CUDA.

FlashInfer plans a batch before running it: the builder turns the step's block table
into FlashInfer's page lists (``paged_kv_indptr``, ``paged_kv_indices``,
``paged_kv_last_page_len``) once per step, and a wrapper is planned lazily per layer
kind (scale, window, soft-cap, causality, heads, dtype) on its first layer in the step
and reused by the others. The cache layout is the Triton backend's (FlashInfer's
"NHD": ``[num_pages, page_size, kv_heads, head_size]`` per K and V), written by the
same kernel. Variants FlashInfer has no form for (sinks, chunked local attention,
CacheBlend's scattered queries, float32) run the Triton kernel instead, per call.

Planning reads host copies of the page lists, so graphs are not captured over it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.attention.backends.abstract import AttentionBackend
from kvserve.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)
from kvserve.attention.backends.utils import CommonAttentionMetadata
from kvserve.attention.ops.triton_reshape_and_cache import reshape_and_cache

# FlashInfer's planning scratch (vLLM's size); one per builder, shared by its wrappers.
WORKSPACE_BYTES = 128 << 20
_FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class FlashInferMetadata(TritonAttentionMetadata):
    # FlashInfer's page lists for this step (device int32), and the builder's planner.
    paged_kv_indptr: torch.Tensor | None = None
    paged_kv_indices: torch.Tensor | None = None
    paged_kv_last_page_len: torch.Tensor | None = None
    planner: _Planner | None = None
    # Layer kinds planned for this step: key -> planned wrapper.
    planned: dict[tuple[Any, ...], Any] = field(default_factory=dict)


class _Planner:
    """Owns the workspace and one prefill wrapper per layer kind across steps."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._workspace: torch.Tensor | None = None
        self._wrappers: dict[tuple[Any, ...], Any] = {}

    def wrapper(self, key: tuple[Any, ...]) -> Any:
        if key not in self._wrappers:
            flashinfer = importlib.import_module("flashinfer")
            if self._workspace is None:
                self._workspace = torch.empty(
                    WORKSPACE_BYTES, dtype=torch.uint8, device=self.device
                )
            self._wrappers[key] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, "NHD"
            )
        return self._wrappers[key]


class FlashInferMetadataBuilder(TritonAttentionMetadataBuilder):
    cudagraph_support = False  # planning reads the page lists on the host

    def __init__(self, block_size: int, device: torch.device | str) -> None:
        super().__init__(block_size, device)
        self.planner = _Planner(self.device)

    def build(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        base = super().build(common)
        num_reqs = common.num_reqs
        seq_lens = base.seq_lens.long()
        pages = (seq_lens + self.block_size - 1) // self.block_size
        indptr = torch.zeros(num_reqs + 1, dtype=torch.int32, device=seq_lens.device)
        indptr[1:] = torch.cumsum(pages, 0, dtype=torch.int32)
        table = base.block_table[:num_reqs]
        used = torch.arange(table.shape[1], device=table.device)[None, :] < pages[:, None]
        return FlashInferMetadata(
            **vars(base),
            paged_kv_indptr=indptr,
            paged_kv_indices=table[used].to(torch.int32),
            paged_kv_last_page_len=((seq_lens - 1) % self.block_size + 1).to(torch.int32),
            planner=self.planner,
        )


class FlashInferImpl(TritonAttentionImpl):
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
        v = self.variant()
        if (
            not isinstance(md, FlashInferMetadata)
            or md.planner is None
            or not query.is_cuda
            or query.dtype not in _FLASHINFER_DTYPES
            or kv_cache.dtype != query.dtype
            or v.num_sink_tokens
            or v.attention_chunk_size is not None
            or md.positions is not None
        ):
            return super().forward(layer, query, key, value, kv_cache, md)
        n = md.num_actual_tokens
        reshape_and_cache(key, value, kv_cache, md.slot_mapping, n)
        output = torch.empty_like(query)
        if n < query.shape[0]:
            output[n:] = 0  # padding rows: the CPU backend's zeros
        if n == 0 or md.num_reqs == 0:
            return output
        kind = (v.scale, v.causal, v.sliding_window, v.logits_soft_cap, self.num_heads,
                self.num_kv_heads, self.head_size, query.dtype)  # fmt: skip
        wrapper = md.planned.get(kind)
        if wrapper is None:
            wrapper = md.planner.wrapper(kind)
            wrapper.plan(
                md.query_start_loc[: md.num_reqs + 1],
                md.paged_kv_indptr,
                md.paged_kv_indices,
                md.paged_kv_last_page_len,
                self.num_heads,
                self.num_kv_heads,
                self.head_size,
                kv_cache.shape[2],
                causal=v.causal,
                # FlashInfer's window counts the keys left of the query: W - 1.
                window_left=v.sliding_window - 1 if v.sliding_window is not None else -1,
                logits_soft_cap=v.logits_soft_cap,
                sm_scale=v.scale,
                q_data_type=query.dtype,
                kv_data_type=kv_cache.dtype,
            )
            md.planned[kind] = wrapper
        output[:n] = wrapper.run(query[:n].contiguous(), (kv_cache[0], kv_cache[1]))
        return output


class FlashInferBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "FLASHINFER"

    get_kv_cache_shape = staticmethod(TritonAttentionBackend.get_kv_cache_shape)

    @staticmethod
    def get_builder_cls() -> type[FlashInferMetadataBuilder]:
        return FlashInferMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[FlashInferImpl]:
        return FlashInferImpl
