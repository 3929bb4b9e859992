"""Paged decode attention and its split-K (csrc/decode_attention.cpp,
csrc/decode_attention_split.cpp): a long context is cut into partitions whose bounds
depend on the request's own context only, attended on whichever threads and merged by
log-sum-exp in a fixed order. Outputs must equal a float64 reference up to float32
rounding, and be the same bit for bit on any number of threads and in any batch."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve import _custom_ops as ops
from tests.csrc.paged_decode import paged_cache, reference, run_kernel
from tests.kernel_support import require_kernels

require_kernels()


def _paged(
    rng: random.Random, lens: list[int], heads: int, kv_heads: int, head: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Keys and values rounded to the cache's type, as it holds them."""

    def rows(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        k = torch.randn(n, kv_heads, head).to(dtype)
        v = torch.randn(n, kv_heads, head).to(dtype)
        return k, v, k.double(), v.double()

    return paged_cache(rng, lens, rows, (kv_heads, head), dtype)


def _kernel(
    q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, lens: list[int], window: int,
    threads: int,
) -> torch.Tensor:  # fmt: skip
    return run_kernel(
        ops.cache_and_decode_attention, q, cache, table, lens, window, threads, cache.shape[4]
    )


def _ragged(rng: random.Random, n: int, longest: int) -> list[int]:
    """n context lengths up to `longest`, one of them `longest`, a few empty."""
    lens = [rng.choice([0, rng.randint(1, 40), rng.randint(1, longest)]) for _ in range(n - 1)]
    return [*lens, longest]


CASES = [
    # (requests' context lengths, heads, kv heads, head size, window, cache type)
    ([3000], 8, 2, 64, 0, torch.float32),  # single stream, GQA
    ([5000, 17, 700], 6, 2, 64, 0, torch.float32),  # ragged
    ([4000, 0, 300], 4, 4, 16, 0, torch.float32),  # a request with no context
    ([2500, 1800], 8, 2, 64, 1000, torch.float32),  # sliding window
    ([2500], 6, 3, 12, 700, torch.float32),  # portable loops (head size 12)
    ([3100], 8, 2, 64, 0, torch.float16),
    ([2100, 900], 8, 1, 32, 0, torch.bfloat16),  # MQA
    ([5000, 511, 512, 1], 9, 3, 64, 0, torch.float16),  # SmolLM2's heads, split edges
    (("ragged", 16, 5000), 4, 2, 32, 0, torch.bfloat16),
    (("ragged", 64, 2000), 4, 1, 32, 0, torch.float32),
    (("ragged", 256, 700), 2, 2, 16, 300, torch.float32),
]


def _case(lens: object) -> list[int]:
    if isinstance(lens, tuple):
        _, n, longest = lens
        return _ragged(random.Random(n), n, longest)
    assert isinstance(lens, list)
    return lens


@pytest.mark.parametrize(("lens", "heads", "kv_heads", "head", "window", "dtype"), CASES)
def test_equal_to_the_reference_and_the_same_on_any_threads(
    lens: object, heads: int, kv_heads: int, head: int, window: int, dtype: torch.dtype
) -> None:
    lens = _case(lens)
    rng = random.Random(len(lens) * 1000 + head)
    torch.manual_seed(sum(lens))
    cache, table, keys, values = _paged(rng, lens, heads, kv_heads, head, dtype)
    q = torch.randn(len(lens), heads, head)
    one = _kernel(q, cache, table, lens, window, 1)
    torch.testing.assert_close(
        one.double(), reference(q, keys, values, window), rtol=1e-5, atol=2e-6
    )
    for threads in (2, 3):
        assert torch.equal(_kernel(q, cache, table, lens, window, threads), one), threads
    contexts = [min(n, window) if window > 0 else n for n in lens]
    for r, n in enumerate(contexts):
        if n == 0:
            assert torch.equal(one[r], torch.zeros_like(one[r]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_request_attends_the_same_alone_and_in_any_batch(dtype: torch.dtype) -> None:
    """A request's output is a function of its own context: alone on one or two threads,
    at any place in batches of 3 to 40 ragged requests, it is the same bit for bit (the
    partitions, and with them the merge's rounding, never follow the batch)."""
    rng = random.Random(3)
    torch.manual_seed(3)
    lens = _ragged(rng, 40, 4000)
    cache, table, _, _ = _paged(rng, lens, 6, 2, 64, dtype)
    q = torch.randn(len(lens), 6, 64)
    alone = {}
    for r in (0, 5, len(lens) - 1):
        alone[r] = _kernel(q[r : r + 1], cache, table[r : r + 1], lens[r : r + 1], 0, 2)[0]
        single = _kernel(q[r : r + 1], cache, table[r : r + 1], lens[r : r + 1], 0, 1)[0]
        assert torch.equal(single, alone[r])
    for size in (3, 9, 40):
        picked = rng.sample(range(len(lens)), size - len(alone)) + list(alone)
        picked = [r for r in dict.fromkeys(picked)]
        rng.shuffle(picked)
        for threads in (1, 2):
            out = _kernel(q[picked], cache, table[picked], [lens[r] for r in picked], 0, threads)
            for row, r in enumerate(picked):
                if r in alone:
                    assert torch.equal(out[row], alone[r]), (size, threads, r)


def test_the_rule_reads_the_context_alone() -> None:
    assert ops.decode_attention_partitions(0) == 1
    assert ops.decode_attention_partitions(511) == 1
    assert ops.decode_attention_partitions(512) == 2  # partitions of >= 256 tokens
    assert ops.decode_attention_partitions(767) == 2
    assert ops.decode_attention_partitions(800) == 2  # 3 of >= 256 tokens: an even count
    assert ops.decode_attention_partitions(3000) == 10
    assert ops.decode_attention_partitions(4096) == 16
    assert ops.decode_attention_partitions(1 << 20) == 16  # at most 16
    # Split contexts always have an even count: two threads get equal shares of a
    # single stream's partitions.
    assert all(ops.decode_attention_partitions(c) % 2 == 0 for c in range(512, 5000, 37))
