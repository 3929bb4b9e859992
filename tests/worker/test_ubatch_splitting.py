"""Where dual batch overlap cuts a step: the two micro-batches cover the step exactly, at
the most even request boundary, only past the thresholds; a step where an earlier
micro-batch would read a block a later one writes stays whole; and attention over each
micro-batch's own metadata equals attention over the whole step."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvserve.attention.backends.registry import get_attn_backend
from kvserve.attention.backends.utils import (
    make_common_attn_metadata,
    slice_common_attn_metadata,
)
from kvserve.worker.ubatch_splitting import create_ubatch_slices, reads_later_writes


def _qsl(query_lens: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)


def test_slices_cover_the_step_exactly_at_the_most_even_request_boundary() -> None:
    rng = random.Random(0)
    for _ in range(300):
        query_lens = [
            rng.choice([1, 1, 1, rng.randrange(1, 40)]) for _ in range(rng.randrange(2, 12))
        ]
        qsl = _qsl(query_lens)
        total = int(qsl[-1])
        slices = create_ubatch_slices(qsl, 2, 2)
        assert slices is not None and len(slices) == 2
        first, second = slices
        # Whole requests, in order, every request and every token exactly once.
        assert first.request_slice.start == 0 and first.token_slice.start == 0
        assert first.request_slice.stop == second.request_slice.start
        assert first.token_slice.stop == second.token_slice.start
        assert second.request_slice.stop == len(query_lens) and second.token_slice.stop == total
        cut = first.request_slice.stop
        assert 0 < cut < len(query_lens)
        assert first.token_slice.stop == qsl[cut]
        assert first.num_tokens + second.num_tokens == total
        # No other boundary splits the tokens more evenly.
        best = min(abs(2 * int(qsl[c]) - total) for c in range(1, len(query_lens)))
        assert abs(2 * first.num_tokens - total) == best


def test_a_step_is_cut_only_past_its_threshold_and_with_two_requests() -> None:
    decodes = _qsl([1] * 8)
    assert create_ubatch_slices(decodes, 9, 2) is None  # 8 decode tokens < 9
    assert create_ubatch_slices(decodes, 8, 1000) is not None
    mixed = _qsl([1, 1, 6])  # a prefill chunk: the prefill threshold applies
    assert create_ubatch_slices(mixed, 2, 9) is None
    assert create_ubatch_slices(mixed, 1000, 8) is not None
    assert create_ubatch_slices(_qsl([50]), 2, 2) is None  # one request
    cut = create_ubatch_slices(_qsl([1, 1, 6]), 2, 2)
    assert cut is not None and cut[0].request_slice == slice(0, 2)  # 2 vs 6 beats 1 vs 7


def test_an_earlier_micro_batch_reading_a_later_ones_writes_keeps_the_step_whole() -> None:
    block_size = 4
    # Request 1 (second micro-batch) writes block 7; request 0 has 8 computed tokens.
    query_lens, computed = [1, 5], [8, 0]
    slices = create_ubatch_slices(_qsl(query_lens), 2, 2)
    assert slices is not None and slices[0].request_slice == slice(0, 1)
    clash = make_common_attn_metadata(query_lens, computed, [[3, 7, 9], [7, 11]], block_size)
    assert reads_later_writes([clash], [block_size], slices)
    apart = make_common_attn_metadata(query_lens, computed, [[3, 5, 9], [7, 11]], block_size)
    assert not reads_later_writes([apart], [block_size], slices)
    # The other way round (the later micro-batch reads the earlier one's block) is safe.
    later_reads = make_common_attn_metadata([5, 1], [0, 8], [[7, 11], [7, 5, 9]], block_size)
    assert not reads_later_writes([later_reads], [block_size], slices)


@pytest.mark.parametrize("seed", [0, 1])
def test_attention_over_micro_batch_metadata_equals_the_whole_steps(seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    block_size, heads, kv_heads, head = 4, 4, 2, 8
    query_lens = [1, 7, 1, 1, 12, 3, 1]
    computed = [9, 0, 14, 3, 5, 8, 21]
    seq_lens = [c + q for c, q in zip(computed, query_lens, strict=True)]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 2
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables = []
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(pool[:n])
        pool = pool[n:]
    backend = get_attn_backend("cpu")
    shape = backend.get_kv_cache_shape(num_blocks, block_size, kv_heads, head)
    cache = torch.randn(shape)  # the computed prefixes: whatever earlier steps wrote
    total = sum(query_lens)
    q = torch.randn(total, heads, head)
    k, v = torch.randn(total, kv_heads, head), torch.randn(total, kv_heads, head)
    impl = backend.get_impl_cls()(heads, head, head**-0.5, kv_heads, None)
    builder_cls = backend.get_builder_cls()
    common = make_common_attn_metadata(query_lens, computed, tables, block_size)

    whole_cache = cache.clone()
    whole = impl.forward(
        torch.nn.Module(), q, k, v, whole_cache, builder_cls(block_size, "cpu").build(common)
    )
    slices = create_ubatch_slices(_qsl(query_lens), 2, 2)
    assert slices is not None
    parts = []
    for s in slices:
        metadata = builder_cls(block_size, "cpu").build(
            slice_common_attn_metadata(common, s.request_slice, s.token_slice)
        )
        t = s.token_slice
        parts.append(impl.forward(torch.nn.Module(), q[t], k[t], v[t], cache, metadata))
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache, whole_cache, rtol=0, atol=0)  # the same slots written
