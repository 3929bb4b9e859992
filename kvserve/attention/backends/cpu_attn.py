"""Paged attention in plain PyTorch (the CPU backend; also runs on CUDA tensors).

A step's batch is split into two groups by the builder:

* decodes (query_len == 1): one call of the C++ kernel, which also writes the step's K/V
  into the cache and reads each request's keys and values in place through the block
  table (without the kernels: gathered all at once and served by one batched SDPA call
  with a length mask);
* prefill chunks (query_len > 1, possibly starting after cached tokens): one SDPA per
  request with a causal mask shifted by ``num_computed_tokens``.

Layers with a sliding window, chunked local attention, sinks or soft-capped scores use
one visibility rule (``visible_keys``) in both groups. The kernel handles plain and
sliding-window decodes; the other variants take the torch path, and soft-capped layers
an explicit matmul/tanh/softmax (SDPA cannot cap scores).

All index and mask tensors are built once per step in the builder; the per-layer
work is gathers, one scatter and SDPA.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve import _custom_ops as ops
from kvserve.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
)
from kvserve.attention.backends.cascade import (
    CascadeMetadata,
    build_cascade_metadata,
    cascade_decode,
)
from kvserve.attention.backends.cpu_decode_inputs import CPUDecodeInputs
from kvserve.attention.backends.kv_cache_codec import kv_cache_codec
from kvserve.attention.backends.utils import (
    CommonAttentionMetadata,
    visible_keys,
)
from kvserve.utils.numpy_views import numpy_view

# (sliding_window, attention_chunk_size, num_sink_tokens): one layer kind's mask key.
MaskKey = tuple[int | None, int | None, int]


@dataclass
class PrefillChunk:
    """One request whose step has more than one query token."""

    token_start: int  # slice of the flattened batch
    token_end: int
    seq_len: int  # context length after this step (cached prefix + chunk)
    block_ids: torch.Tensor  # int64 [ceil(seq_len / block_size)]
    query_positions: torch.Tensor  # int64 [query_len], absolute positions
    causal_mask: torch.Tensor  # bool [query_len, seq_len]: True = may attend
    # Masks of windowed/chunked layers, made by the first layer of each kind.
    masks: dict[MaskKey, torch.Tensor] = field(default_factory=dict)
    # Keys past the causal cut a query also sees [query_len, seq_len], OR-ed into every
    # layer's mask: a VLM's image tokens see their whole image (Gemma 3). None: causal.
    extra_visible: torch.Tensor | None = None

    def mask_for(self, key: MaskKey) -> torch.Tensor:
        if key not in self.masks:
            k_pos = torch.arange(self.seq_len, device=self.causal_mask.device)
            self.masks[key] = visible_keys(self.query_positions[:, None], k_pos[None, :], *key)
        return self.masks[key]


@dataclass
class DecodeBatch:
    """All single-token requests of the step, padded to a common key length."""

    token_indices: torch.Tensor  # int64 [D] into the flattened batch
    block_table_i32: torch.Tensor  # int32 [D, num_blocks], contiguous, no -1 (the kernel's)
    seq_lens_i32: torch.Tensor  # int32 [D]
    block_size: int

    # The torch fallback's views, made only when it runs (the kernel path needs neither).
    @functools.cached_property
    def block_table(self) -> torch.Tensor:  # int64 [D, num_blocks]
        return self.block_table_i32.long()

    @functools.cached_property
    def seq_lens(self) -> torch.Tensor:  # int64 [D]
        return self.seq_lens_i32.long()

    @functools.cached_property
    def key_mask(self) -> torch.Tensor:  # bool [D, num_blocks*block_size]
        key_pos = torch.arange(
            self.block_table_i32.shape[1] * self.block_size, device=self.seq_lens_i32.device
        )
        return key_pos[None, :] < self.seq_lens[:, None]

    @functools.cached_property
    def masks(self) -> dict[MaskKey, torch.Tensor]:
        return {}

    def mask_for(self, key: MaskKey) -> torch.Tensor:
        """``key_mask`` narrowed by one layer kind's visibility (query = the last token)."""
        if key not in self.masks:
            key_mask = self.key_mask
            k_pos = torch.arange(key_mask.shape[1], device=key_mask.device)
            visible = visible_keys((self.seq_lens - 1)[:, None], k_pos[None, :], *key)
            self.masks[key] = key_mask & visible
        return self.masks[key]


@dataclass
class CPUAttentionMetadata:
    num_actual_tokens: int
    block_size: int
    slot_mapping: torch.Tensor  # int64, only the valid (>= 0) slots
    slot_token_indices: torch.Tensor | None  # tokens owning those slots; None = all
    decode: DecodeBatch | None
    prefills: list[PrefillChunk] = field(default_factory=list)
    # The kernel's inputs, prepared once per step: every token's slot (-1 = skip) and the
    # decode rows' (block_table_i32, seq_lens_i32, token_indices), empty without decodes.
    all_slots: torch.Tensor | None = None
    kernel_decode: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # The decode rows' split at a shared prefix (cascade.py); None: attend row by row.
    cascade: CascadeMetadata | None = None

    def select_tokens(self, keep: torch.Tensor) -> CPUAttentionMetadata:
        """The metadata of a step that goes on with only the tokens ``keep`` (sorted
        int64 indices into this step's tokens; CacheBlend's recomputed tokens). Every
        request keeps its context: a prefill's kept queries attend to the whole cache up
        to their positions, the other tokens' K/V being whatever the cache holds. A
        decode or prefill row must keep its last token."""
        device = keep.device
        new_index = torch.full((self.num_actual_tokens,), -1, dtype=torch.long, device=device)
        new_index[keep] = torch.arange(keep.shape[0], device=device)
        assert self.all_slots is not None
        all_slots = self.all_slots[keep]
        slot_mapping, token_indices = all_slots, None
        if _any_negative(all_slots):
            token_indices = torch.nonzero(all_slots >= 0).flatten()
            slot_mapping = all_slots[token_indices]
        decode = self.decode
        if decode is not None:
            decode = dataclasses.replace(decode, token_indices=new_index[decode.token_indices])
        kernel_decode = self.kernel_decode
        if kernel_decode is not None and decode is not None:
            kernel_decode = (kernel_decode[0], kernel_decode[1], decode.token_indices)
        prefills = []
        for chunk in self.prefills:
            rows = keep[(keep >= chunk.token_start) & (keep < chunk.token_end)]
            local = rows - chunk.token_start
            start = int(new_index[rows[0]])
            prefills.append(
                PrefillChunk(
                    token_start=start,
                    token_end=start + rows.shape[0],
                    seq_len=chunk.seq_len,
                    block_ids=chunk.block_ids,
                    query_positions=chunk.query_positions[local],
                    causal_mask=chunk.causal_mask[local],
                    masks={key: mask[local] for key, mask in chunk.masks.items()},
                    extra_visible=(
                        None if chunk.extra_visible is None else chunk.extra_visible[local]
                    ),
                )
            )
        return CPUAttentionMetadata(
            num_actual_tokens=int(keep.shape[0]),
            block_size=self.block_size,
            slot_mapping=slot_mapping,
            slot_token_indices=token_indices,
            decode=decode,
            prefills=prefills,
            all_slots=all_slots,
            kernel_decode=kernel_decode,
            cascade=self.cascade,
        )


def _any_negative(values: torch.Tensor) -> bool:
    """Whether an index tensor holds a -1. On a CPU numpy answers in ~2 us, where torch's
    compare, any and bool took ~50 us of a single-stream step (AMD EPYC Zen 5)."""
    if values.device.type == "cpu":
        return values.numel() > 0 and bool(numpy_view(values).min() < 0)
    return bool((values < 0).any())


class CPUAttentionMetadataBuilder(AttentionMetadataBuilder):
    def __init__(self, block_size: int, device: torch.device | str) -> None:
        super().__init__(block_size, device)
        # The kernel's decode inputs for steps without decodes, made once.
        self._no_decodes = (
            torch.zeros((0, 1), dtype=torch.int32, device=self.device),
            torch.zeros(0, dtype=torch.int32, device=self.device),
            torch.zeros(0, dtype=torch.long, device=self.device),
        )
        self._cpu_decode = CPUDecodeInputs()

    def build(self, common: CommonAttentionMetadata) -> CPUAttentionMetadata:
        starts = numpy_view(common.query_start_loc_cpu).tolist()
        seq_lens = numpy_view(common.seq_lens_cpu).tolist()
        decode_reqs: list[int] = []
        prefill_reqs: list[int] = []
        for r in range(common.num_reqs):
            query_len = starts[r + 1] - starts[r]
            if query_len == 1:
                decode_reqs.append(r)
            elif query_len > 1:
                prefill_reqs.append(r)

        prefills: list[PrefillChunk] = []
        if prefill_reqs:
            # Padding entries of the block table may hold -1; they are masked out but
            # must still be valid gather indices.
            block_table = common.block_table_tensor.clamp(min=0).long()
            computed = common.num_computed_tokens_cpu.tolist()
            prefills = [
                self._prefill(block_table[r], starts[r], starts[r + 1], computed[r], seq_lens[r])
                for r in prefill_reqs
            ]

        all_slots = common.slot_mapping
        if all_slots.shape[0] != common.num_actual_tokens:
            all_slots = all_slots[: common.num_actual_tokens]
        if all_slots.dtype != torch.int64:  # each skipped call saves a dispatch per step
            all_slots = all_slots.long()
        slot_mapping, token_indices = all_slots, None
        if _any_negative(all_slots):  # one sync per step, not per layer
            token_indices = torch.nonzero(all_slots >= 0).flatten()
            slot_mapping = all_slots[token_indices]

        decode = self._decode(common, decode_reqs, starts, seq_lens)
        cascade = build_cascade_metadata(common, decode, self.block_size)
        kernel_decode: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = self._no_decodes
        if cascade is not None:
            kernel_decode = None  # cascade runs in torch (and the fused decode stack declines)
        elif decode is not None:
            kernel_decode = (decode.block_table_i32, decode.seq_lens_i32, decode.token_indices)
        return CPUAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            block_size=self.block_size,
            slot_mapping=slot_mapping,
            slot_token_indices=token_indices,
            decode=decode,
            prefills=prefills,
            all_slots=all_slots,
            kernel_decode=kernel_decode,
            cascade=cascade,
        )

    def _prefill(
        self, block_row: torch.Tensor, start: int, end: int, num_computed: int, seq_len: int
    ) -> PrefillChunk:
        device = block_row.device
        num_blocks = -(-seq_len // self.block_size)
        q_pos = torch.arange(num_computed, num_computed + end - start, device=device)
        k_pos = torch.arange(seq_len, device=device)
        return PrefillChunk(
            token_start=start,
            token_end=end,
            seq_len=seq_len,
            block_ids=block_row[:num_blocks],
            query_positions=q_pos,
            causal_mask=k_pos[None, :] <= q_pos[:, None],
        )

    def _decode(
        self,
        common: CommonAttentionMetadata,
        reqs: list[int],
        starts: list[int],
        seq_lens: list[int],
    ) -> DecodeBatch | None:
        if not reqs:
            return None
        device = common.block_table_tensor.device
        lens = [seq_lens[r] for r in reqs]
        num_blocks = -(-max(lens) // self.block_size)
        token_starts = [starts[r] for r in reqs]
        if device.type == "cpu":
            token_indices, block_table_i32, seq_lens_i32 = self._cpu_decode.build(
                common.block_table_tensor, common.num_reqs, reqs, token_starts, lens, num_blocks
            )
            return DecodeBatch(token_indices, block_table_i32, seq_lens_i32, self.block_size)
        table = common.block_table_tensor[: common.num_reqs, :num_blocks]
        if len(reqs) < common.num_reqs:
            table = table[torch.tensor(reqs, dtype=torch.long, device=device)]
        return DecodeBatch(
            token_indices=torch.tensor(token_starts, dtype=torch.long, device=device),
            # clamp copies, so the table comes out contiguous.
            block_table_i32=table.clamp(min=0).to(torch.int32),
            seq_lens_i32=torch.tensor(lens, dtype=torch.int32, device=device),
            block_size=self.block_size,
        )


class CPUAttentionImpl(AttentionImpl):
    @property
    def mask_key(self) -> MaskKey | None:
        """None for plain causal attention, else what ``visible_keys`` needs."""
        if self.sliding_window is None and self.attention_chunk_size is None:
            return None
        return self.sliding_window, self.attention_chunk_size, self.num_sink_tokens

    @property
    def kernel_supported(self) -> bool:
        # The C++ decode kernel knows causal and sliding-window attention only.
        return (
            self.attention_chunk_size is None
            and self.logits_soft_cap is None
            and self.num_sink_tokens == 0
        )

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata,
    ) -> torch.Tensor:
        md = attn_metadata
        n = md.num_actual_tokens
        codec = kv_cache_codec(kv_cache)  # float elements, or int8 rows with their scales
        use_kernel = md.kernel_decode is not None and md.all_slots is not None
        if use_kernel and self.kernel_supported and ops.use_for(query):
            assert md.kernel_decode is not None and md.all_slots is not None
            # Every row below n is a decode (written by the kernel) or a prefill (written
            # below); rows past n are padding and keep zeros.
            if n == query.shape[0] and not md.prefills:
                output = torch.empty_like(query)
            else:
                output = torch.zeros_like(query)
            # One call: this step's K/V into the cache, then the decode rows' attention.
            codec.cache_and_decode(
                output, query, key, value, kv_cache, md.all_slots, *md.kernel_decode,
                self.scale, self.sliding_window,
            )  # fmt: skip
            if not md.prefills:
                return output
        else:
            codec.write(key[:n], value[:n], kv_cache, md.slot_mapping, md.slot_token_indices)
            output = torch.zeros_like(query)
            if md.cascade is not None and md.decode is not None:
                cascade_decode(self, output, query, key, value, kv_cache, md.decode, md.cascade)
            elif md.decode is not None:
                k_cache, v_cache = kv_cache[0], kv_cache[1]
                output[md.decode.token_indices] = self._decode(query, k_cache, v_cache, md.decode)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        for chunk in md.prefills:
            q = query[chunk.token_start : chunk.token_end]
            output[chunk.token_start : chunk.token_end] = self._prefill(q, k_cache, v_cache, chunk)
        return output

    def _decode(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, d: DecodeBatch
    ) -> torch.Tensor:
        num_reqs = d.block_table.shape[0]
        # [D, nb, bs, Hkv, hd] -> [D, Hkv, L, hd]
        widen = kv_cache_codec(k_cache).widen  # a float16/bfloat16/int8 cache, widened
        k = widen(k_cache[d.block_table], query.dtype)
        v = widen(v_cache[d.block_table], query.dtype)
        k = k.reshape(num_reqs, -1, self.num_kv_heads, self.head_size)
        v = v.reshape(num_reqs, -1, self.num_kv_heads, self.head_size)
        key = self.mask_key
        mask = d.key_mask if key is None else d.mask_for(key)
        q = query[d.token_indices].unsqueeze(2)  # [D, Hq, 1, hd]
        out = self._attend(q, k.transpose(1, 2), v.transpose(1, 2), mask[:, None, None, :])
        return out.squeeze(2)

    def _prefill(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, c: PrefillChunk
    ) -> torch.Tensor:
        # The cache already holds this chunk's K/V (written above), so one gather
        # covers the cached prefix and the chunk alike.
        widen = kv_cache_codec(k_cache).widen  # a float16/bfloat16/int8 cache, widened
        k = widen(k_cache[c.block_ids], q.dtype).reshape(-1, self.num_kv_heads, self.head_size)
        v = widen(v_cache[c.block_ids], q.dtype).reshape(-1, self.num_kv_heads, self.head_size)
        k, v = k[: c.seq_len], v[: c.seq_len]
        key = self.mask_key
        mask: torch.Tensor | None = c.causal_mask if key is None else c.mask_for(key)
        if not self.causal:
            mask = torch.ones_like(c.causal_mask)  # encoder-only: the whole prompt, both ways
        elif c.extra_visible is not None:
            mask = (c.causal_mask if key is None else c.mask_for(key)) | c.extra_visible
        elif key is None and q.shape[0] == c.seq_len and self.logits_soft_cap is None:
            mask = None  # nothing cached before the chunk: plain causal attention
        # 4-D inputs: SDPA's fused CPU (flash) kernel takes those, masks and GQA included;
        # 3-D ones fall back to the math path that materializes the score matrix.
        out = self._attend(
            q.transpose(0, 1).unsqueeze(0),  # [1, Hq, Lq, hd]
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            mask,
        )
        return out.squeeze(0).transpose(0, 1)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """``q [B, Hq, Lq, hd]``, ``k/v [B, Hkv, Lk, hd]``, bool ``mask`` broadcast to
        ``[B, Hq, Lq, Lk]`` (None: causal)."""
        if self.logits_soft_cap is None:
            return F.scaled_dot_product_attention(
                q, k, v,
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )  # fmt: skip
        assert mask is not None
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        cap = self.logits_soft_cap
        scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * self.scale / cap) * cap
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)


class CPUAttentionBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_builder_cls() -> type[CPUAttentionMetadataBuilder]:
        return CPUAttentionMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[CPUAttentionImpl]:
        return CPUAttentionImpl
