"""Cross-attention over the paged cache (encoder-decoder models: Whisper), in PyTorch.

A decoder token attends to every encoder position of its own request, with no causal
mask and no rotary embedding. The encoder's K/V live in the request's blocks of the
cross-attention KV cache group (``CrossAttentionSpec``): they are written once, in the
step where the request's first decoder tokens run (its ``num_computed_tokens`` is 0),
and every later step only reads them. Requests with the same encoder input may share
those blocks (``CrossAttentionManager``); writing equal values twice is harmless.

The builder turns the group's block table into per-request gathers once per step; the
layers then write (first steps only) and attend: decode rows together in one SDPA call,
prefill rows one call each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
)
from kvserve.attention.backends.cpu_attn import CPUAttentionBackend
from kvserve.attention.backends.utils import CommonAttentionMetadata, write_to_kv_cache
from kvserve.utils.numpy_views import numpy_view


@dataclass
class CrossAttentionMetadata:
    num_actual_tokens: int
    block_size: int
    query_start_loc: list[int]  # [R + 1], CPU
    block_table: torch.Tensor  # int64 [R, max blocks], -1 clamped to 0
    # Rows whose encoder K/V are written in this step, in batch order: the order the
    # model's encoder outputs come in.
    write_rows: list[int]
    # Rows with one query token, and those tokens' indices in the flattened batch.
    decode_rows: list[int]
    decode_tokens: torch.Tensor
    # write_slots' answers: the first layer computes them, the others reuse them.
    _slots: dict[int, torch.Tensor] = field(default_factory=dict)

    def num_blocks(self, encoder_len: int) -> int:
        return -(-encoder_len // self.block_size)

    def write_slots(self, encoder_len: int) -> torch.Tensor:
        """Slots of positions 0 .. encoder_len-1 of each write row, concatenated."""
        if encoder_len not in self._slots:
            pos = torch.arange(encoder_len, device=self.block_table.device)
            rows = self.block_table[self.write_rows][:, pos // self.block_size]
            self._slots[encoder_len] = (rows * self.block_size + pos % self.block_size).reshape(-1)
        return self._slots[encoder_len]


class CrossAttentionMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> CrossAttentionMetadata:
        n = common.num_reqs
        starts = numpy_view(common.query_start_loc_cpu).tolist()[: n + 1]
        computed = numpy_view(common.num_computed_tokens_cpu).tolist()[:n]
        write_rows = [r for r in range(n) if computed[r] == 0 and starts[r + 1] > starts[r]]
        decode_rows = [r for r in range(n) if starts[r + 1] - starts[r] == 1]
        decode_tokens = torch.tensor([starts[r] for r in decode_rows], dtype=torch.long)
        return CrossAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            block_size=self.block_size,
            query_start_loc=starts,
            block_table=common.block_table_tensor[:n].clamp(min=0).long(),
            write_rows=write_rows,
            decode_rows=decode_rows,
            decode_tokens=decode_tokens.to(self.device),
        )


class CrossAttentionImpl(AttentionImpl):
    """``key``/``value`` are the encoder's K/V of the step's write rows (None when no row
    starts in this step); ``max_encoder_len`` positions per row."""

    max_encoder_len = 0  # set by the CrossAttention layer

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: CrossAttentionMetadata,
    ) -> torch.Tensor:
        md = attn_metadata
        length = self.max_encoder_len
        if key is not None and value is not None and md.write_rows:
            slots = md.write_slots(length)
            if key.shape[0] != slots.shape[0]:
                raise RuntimeError(
                    f"{key.shape[0]} encoder positions for {len(md.write_rows)} requests of "
                    f"{length} positions each"
                )
            write_to_kv_cache(key, value, kv_cache, slots)
        output = torch.zeros_like(query)
        num_blocks = md.num_blocks(length)
        k_cache, v_cache = kv_cache[0], kv_cache[1]

        def gather(rows: torch.Tensor | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            table = md.block_table[rows, :num_blocks]  # [R, nb]
            k = k_cache[table].reshape(table.shape[0], -1, self.num_kv_heads, self.head_size)
            v = v_cache[table].reshape(table.shape[0], -1, self.num_kv_heads, self.head_size)
            # [R, Hkv, L, hd], widened from a narrower cache dtype
            return (
                k[:, :length].transpose(1, 2).to(query.dtype),
                v[:, :length].transpose(1, 2).to(query.dtype),
            )

        if md.decode_rows:
            k, v = gather(md.decode_rows)
            q = query[md.decode_tokens].unsqueeze(2)  # [D, Hq, 1, hd]
            output[md.decode_tokens] = self._attend(q, k, v).squeeze(2)
        starts = md.query_start_loc
        for r in range(len(starts) - 1):
            lo, hi = starts[r], starts[r + 1]
            if hi - lo <= 1:
                continue
            k, v = gather([r])
            q = query[lo:hi].transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, hd]
            output[lo:hi] = self._attend(q, k, v).squeeze(0).transpose(0, 1)
        return output

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads
        )


class CrossAttentionBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CROSS_ATTN"

    # The CPU backend's layout, so a cross layer shares a tensor with a decoder layer.
    get_kv_cache_shape = staticmethod(CPUAttentionBackend.get_kv_cache_shape)

    @staticmethod
    def get_builder_cls() -> type[CrossAttentionMetadataBuilder]:
        return CrossAttentionMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[CrossAttentionImpl]:
        return CrossAttentionImpl
