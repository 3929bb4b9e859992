"""Sliding window, chunked local attention, sinks and soft-capped scores on the paged
CPU backend (C++ decode kernel where it applies, torch path otherwise), against a naive
per-query loop that spells the visibility rule out position by position.

Blocks that no query of the step can see are swapped for the null block (block 0),
filled with huge values, as the windowed KV cache managers leave them: the mask alone
must keep them out."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch

from kvserve import _custom_ops as ops
from kvserve.attention.backends.cpu_attn import CPUAttentionBackend
from kvserve.attention.backends.utils import make_common_attn_metadata, visible_keys

NUM_HEADS, NUM_KV_HEADS, HEAD, BLOCK = 4, 2, 16, 4
NULL_BLOCK = 0


@dataclass(frozen=True)
class Variant:
    window: int | None = None
    chunk: int | None = None
    sinks: int = 0
    soft_cap: float | None = None

    def sees(self, q: int, k: int) -> bool:
        if k > q:
            return False
        if self.window is not None and k <= q - self.window and k >= self.sinks:
            return False
        return self.chunk is None or k // self.chunk == q // self.chunk


def naive(
    variant: Variant, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int
) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        pos = first_pos + i
        keys = [j for j in range(pos + 1) if variant.sees(pos, j)]
        scores = torch.einsum("hd,shd->hs", q[i], k[keys]) * HEAD**-0.5
        if variant.soft_cap is not None:
            scores = variant.soft_cap * torch.tanh(scores / variant.soft_cap)
        out[i] = torch.einsum("hs,shd->hd", scores.softmax(-1), v[keys])
    return out


def run(variant: Variant, query_lens: list[int], computed: list[int], seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    seq_lens = [c + n for c, n in zip(computed, query_lens, strict=True)]
    needed = [-(-s // BLOCK) for s in seq_lens]
    pool = list(range(1, sum(needed) + 1))  # block 0 is the null block
    rng.shuffle(pool)
    tables = []
    for n in needed:
        tables.append(pool[:n])
        pool = pool[n:]
    kv_cache = torch.zeros(CPUAttentionBackend.get_kv_cache_shape(sum(needed) + 1, BLOCK, 2, HEAD))
    full_k = [torch.randn(s, NUM_KV_HEADS, HEAD) for s in seq_lens]
    full_v = [torch.randn(s, NUM_KV_HEADS, HEAD) for s in seq_lens]
    for r, c in enumerate(computed):
        for pos in range(c):
            block, off = tables[r][pos // BLOCK], pos % BLOCK
            kv_cache[0, block, off], kv_cache[1, block, off] = full_k[r][pos], full_v[r][pos]
    swapped = 0
    for r, c in enumerate(computed):
        for b in range(needed[r]):
            positions = range(b * BLOCK, min((b + 1) * BLOCK, seq_lens[r]))
            unseen = all(not variant.sees(q, k) for q in range(c, seq_lens[r]) for k in positions)
            if unseen:
                tables[r][b] = NULL_BLOCK
                swapped += 1
    kv_cache[:, NULL_BLOCK] = 1e4  # any leak through the mask swamps the result

    common = make_common_attn_metadata(query_lens, computed, tables, BLOCK)
    md = CPUAttentionBackend.get_builder_cls()(BLOCK, "cpu").build(common)
    q = torch.randn(sum(query_lens), NUM_HEADS, HEAD)
    k = torch.cat([full_k[r][c:] for r, c in enumerate(computed)])
    v = torch.cat([full_v[r][c:] for r, c in enumerate(computed)])
    impl = CPUAttentionBackend.get_impl_cls()(
        NUM_HEADS, HEAD, HEAD**-0.5, NUM_KV_HEADS, variant.window, variant.chunk, variant.soft_cap
    )
    impl.num_sink_tokens = variant.sinks
    with ops.disabled():
        out_torch = impl.forward(torch.nn.Module(), q, k, v, kv_cache.clone(), md)
    out = impl.forward(torch.nn.Module(), q, k, v, kv_cache, md)
    start = 0
    for r, n in enumerate(query_lens):
        expected = naive(variant, q[start : start + n], full_k[r], full_v[r], computed[r])
        for result in (out, out_torch):
            torch.testing.assert_close(result[start : start + n], expected, atol=1e-5, rtol=1e-5)
        start += n
    assert swapped > 0 or variant == Variant(soft_cap=variant.soft_cap)


VARIANTS = [
    Variant(window=5),
    Variant(window=8, soft_cap=2.0),
    Variant(chunk=8),
    Variant(chunk=6, soft_cap=1.5),
    Variant(window=6, sinks=4),
    Variant(soft_cap=3.0),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_variant_mixed_batch_matches_naive(variant: Variant) -> None:
    # Decodes far past the window, a fresh prefill, and chunks starting mid-block.
    run(variant, [1, 13, 1, 9, 1], [37, 0, 21, 14, 5], seed=hash(str(variant)) % 1000)
    run(variant, [1] * 6, [3, 9, 16, 24, 31, 40], seed=1)


def test_visibility_rule_one_query() -> None:
    k = torch.arange(20)
    q = torch.tensor(17)
    assert visible_keys(q, k).nonzero().flatten().tolist() == list(range(18))
    assert visible_keys(q, k, sliding_window=4).nonzero().flatten().tolist() == [14, 15, 16, 17]
    assert visible_keys(q, k, attention_chunk_size=8).nonzero().flatten().tolist() == [16, 17]
    sinks = visible_keys(q, k, sliding_window=4, num_sink_tokens=2)
    assert sinks.nonzero().flatten().tolist() == [0, 1, 14, 15, 16, 17]


def test_soft_cap_bounds_scores() -> None:
    # One key scores huge: uncapped it takes all the weight, capped at 1 it cannot.
    impl = CPUAttentionBackend.get_impl_cls()(1, 2, 1.0, 1, None, None, 1.0)
    q = torch.tensor([[[[10.0, 0.0]]]])
    k = torch.tensor([[[[10.0, 0.0], [0.0, 0.0]]]])
    v = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])
    out = impl._attend(q, k, v, torch.ones(1, 2, dtype=torch.bool))
    weight = 1 / (1 + math.exp(-math.tanh(100.0)))
    torch.testing.assert_close(out.flatten(), torch.tensor([weight, 1 - weight]))


def test_invalid_variant_values_are_refused() -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        CPUAttentionBackend.get_impl_cls()(4, 16, 1.0, 2, 0)
    with pytest.raises(ValueError, match="attention_chunk_size"):
        CPUAttentionBackend.get_impl_cls()(4, 16, 1.0, 2, None, -8)
