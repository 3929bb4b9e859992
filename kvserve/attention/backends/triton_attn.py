"""The Triton paged-attention backend (vLLM's TRITON_ATTN): the GPU path.

Per layer and step, two kernel launches and no host work: the step's K/V into the cache
by slot mapping (``ops.triton_reshape_and_cache``), then one unified attention kernel
over every request of the batch, prefill chunks and decodes alike
(``ops.triton_unified_attention``). The metadata builder hands the step's device tensors
through unchanged: no per-request split, no masks, no sync; every variant (window, sinks,
chunked local, soft-cap, encoder-only) is a kernel specialization of the layer.

The cache layout is the CPU backend's, so the hybrid allocator's shared pages, the KV
connectors and the tier read it the same way. Selected on CUDA by the registry; on a
CPU only when forced (``KVSERVE_ATTENTION_BACKEND=TRITON``), where the same kernels run
under Triton's interpreter: how the tests check them without a GPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvserve.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
)
from kvserve.attention.backends.cpu_attn import CPUAttentionBackend
from kvserve.attention.backends.utils import CommonAttentionMetadata
from kvserve.attention.ops.triton_reshape_and_cache import reshape_and_cache
from kvserve.attention.ops.triton_unified_attention import AttentionVariant, unified_attention


@dataclass
class TritonAttentionMetadata:
    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1], device
    seq_lens: torch.Tensor  # int32 [num_reqs], device
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks], device (-1 padding allowed)
    slot_mapping: torch.Tensor  # int64 [num_actual_tokens], -1 = skip, device
    # int32 [num_actual_tokens]: each query's position, where a request's queries are not
    # its last q_len positions (after select_tokens); None: they are.
    positions: torch.Tensor | None = None

    def select_tokens(self, keep: torch.Tensor) -> TritonAttentionMetadata:
        """The metadata of a step that goes on with only the tokens ``keep`` (sorted int64
        indices into this step's tokens; CacheBlend's recomputed tokens). Each request
        keeps its keys: a kept query attends to the cache up to its own position."""
        n = self.num_actual_tokens
        starts = self.query_start_loc.long()
        tokens = torch.arange(n, device=keep.device)
        request = torch.searchsorted(starts[1:], tokens, right=True)
        positions = self.positions
        if positions is None:
            context_lens = self.seq_lens.long() - (starts[1:] - starts[:-1])
            positions = (context_lens[request] + tokens - starts[request]).int()
        counts = torch.bincount(request[keep], minlength=self.num_reqs)
        query_start_loc = torch.zeros_like(self.query_start_loc)
        query_start_loc[1:] = counts.cumsum(0)
        return dataclasses.replace(
            self,
            num_actual_tokens=int(keep.shape[0]),
            max_query_len=int(counts.max()) if self.num_reqs else 0,
            query_start_loc=query_start_loc,
            slot_mapping=self.slot_mapping[keep],
            positions=positions[keep],
        )


class TritonAttentionMetadataBuilder(AttentionMetadataBuilder):
    # Device tensors forwarded as they are; max_seq_len only picks the split count.
    cudagraph_support = True

    def build(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        n = common.num_actual_tokens
        slots = common.slot_mapping
        if slots.shape[0] != n:
            slots = slots[:n]
        return TritonAttentionMetadata(
            num_actual_tokens=n,
            num_reqs=common.num_reqs,
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
            query_start_loc=_int32(common.query_start_loc[: common.num_reqs + 1]),
            seq_lens=_int32(common.seq_lens[: common.num_reqs]),
            block_table=_int32(common.block_table_tensor),
            slot_mapping=slots,
        )


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)


class TritonAttentionImpl(AttentionImpl):
    def variant(self) -> AttentionVariant:
        # Read per call: the model runner turns on StreamingLLM sinks after construction.
        return AttentionVariant(
            scale=self.scale,
            causal=self.causal,
            sliding_window=self.sliding_window,
            attention_chunk_size=self.attention_chunk_size,
            num_sink_tokens=self.num_sink_tokens if self.sliding_window is not None else 0,
            logits_soft_cap=self.logits_soft_cap,
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
        n = md.num_actual_tokens
        reshape_and_cache(key, value, kv_cache, md.slot_mapping, n)
        output = torch.empty_like(query)
        if n < query.shape[0]:
            output[n:] = 0  # padding rows (a captured batch size): the CPU backend's zeros
        unified_attention(
            output, query, kv_cache, md.block_table, md.seq_lens, md.query_start_loc,
            md.num_reqs, n, self.variant(), md.max_seq_len, positions=md.positions,
        )  # fmt: skip
        return output


class TritonAttentionBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "TRITON"

    # The CPU backend's layout: connectors, shared pages and the tiers read it the same way.
    get_kv_cache_shape = staticmethod(CPUAttentionBackend.get_kv_cache_shape)

    @staticmethod
    def get_builder_cls() -> type[TritonAttentionMetadataBuilder]:
        return TritonAttentionMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[TritonAttentionImpl]:
        return TritonAttentionImpl
