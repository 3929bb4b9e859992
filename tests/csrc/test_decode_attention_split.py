"""Split-K in the paged decode attention kernel (csrc/decode_attention_split.cpp): a long
context cut into partitions on different threads, merged by log-sum-exp, must give the
unsplit kernel's output up to float32 rounding, and both the float64 reference's."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from kvserve import _custom_ops as ops

pytestmark = pytest.mark.skipif(not ops.available(), reason="needs the C++ CPU kernels")

BLOCK = 16


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """The test's own torch ops on one thread (the kernel calls set theirs): on a loaded
    2-core machine, spinning OpenMP teams made the many small ops 10-100x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _paged(
    rng: random.Random, lens: list[int], heads: int, kv_heads: int, head: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """A cache holding each request's keys and values in shuffled blocks, its block table,
    and the values as stored (rounded to the cache's type)."""
    need = [-(-n // BLOCK) for n in lens]
    pool = list(range(sum(need) + 2))
    rng.shuffle(pool)
    cache = torch.zeros(2, len(pool), BLOCK, kv_heads, head, dtype=dtype)
    table = torch.zeros(len(lens), max([*need, 1]), dtype=torch.int32)
    keys, values = [], []
    for r, n in enumerate(lens):
        blocks, pool = pool[: need[r]], pool[need[r] :]
        table[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(n, kv_heads, head).to(dtype)
        v = torch.randn(n, kv_heads, head).to(dtype)
        pos = torch.arange(n)
        slots = torch.tensor(blocks, dtype=torch.long)[pos // BLOCK] * BLOCK + pos % BLOCK
        cache[0].view(-1, kv_heads, head)[slots] = k
        cache[1].view(-1, kv_heads, head)[slots] = v
        keys.append(k.double())
        values.append(v.double())
    return cache, table, keys, values


def _kernel(
    q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, lens: list[int], window: int,
    threads: int,
) -> torch.Tensor:  # fmt: skip
    kv_heads, head = cache.shape[3], cache.shape[4]
    empty = torch.empty(0, kv_heads, head)
    out = torch.full_like(q, float("nan"))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ops.cache_and_decode_attention(
            out, q, empty, empty, cache, torch.empty(0, dtype=torch.long), table,
            torch.tensor(lens, dtype=torch.int32), torch.arange(len(lens)), head**-0.5, window,
        )  # fmt: skip
    finally:
        torch.set_num_threads(before)
    return out


def _reference(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], window: int
) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // keys[0].shape[1]
    for r, (k, v) in enumerate(zip(keys, values, strict=True)):
        first = max(0, len(k) - window) if window > 0 else 0
        if len(k) - first <= 0:
            continue
        k = k[first:].repeat_interleave(group, dim=1)
        v = v[first:].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,shd->hs", q[r].double(), k) * q.shape[2] ** -0.5
        out[r] = torch.einsum("hs,shd->hd", scores.softmax(-1), v)
    return out


CASES = [
    # (requests' context lengths, threads, heads, kv heads, head size, window, cache type)
    ([3000], 2, 8, 2, 64, 0, torch.float32),  # single stream, GQA
    ([5000, 17, 700], 2, 6, 2, 64, 0, torch.float32),  # ragged: empty partitions too
    ([4000, 0, 300], 4, 4, 4, 16, 0, torch.float32),  # a request with no context
    ([2500, 1800], 2, 8, 2, 64, 1000, torch.float32),  # sliding window
    ([2500], 2, 6, 3, 12, 700, torch.float32),  # portable loops (head size 12)
    ([3100], 2, 8, 2, 64, 0, torch.float16),
    ([2100, 900], 2, 8, 1, 32, 0, torch.bfloat16),  # MQA
]


@pytest.mark.parametrize(("lens", "threads", "heads", "kv_heads", "head", "window", "dtype"), CASES)
def test_split_k_equals_the_unsplit_kernel_and_the_reference(
    lens: list[int], threads: int, heads: int, kv_heads: int, head: int, window: int,
    dtype: torch.dtype,
) -> None:  # fmt: skip
    rng = random.Random(len(lens) * 1000 + head)
    torch.manual_seed(sum(lens))
    contexts = [min(n, window) if window > 0 else n for n in lens]
    assert ops.decode_attention_partitions(len(lens), max(contexts), threads) > 1
    assert ops.decode_attention_partitions(len(lens), max(contexts), 1) == 1
    cache, table, keys, values = _paged(rng, lens, heads, kv_heads, head, dtype)
    q = torch.randn(len(lens), heads, head)
    split = _kernel(q, cache, table, lens, window, threads)
    unsplit = _kernel(q, cache, table, lens, window, 1)
    torch.testing.assert_close(split, unsplit, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(
        split.double(), _reference(q, keys, values, window), rtol=1e-5, atol=2e-6
    )
    for r, n in enumerate(contexts):
        if n == 0:
            assert torch.equal(split[r], torch.zeros_like(split[r]))


def test_split_k_at_many_requests_with_as_many_threads() -> None:
    """256 ragged requests split only where threads outnumber them a quarter as much: the
    rule's many-request end, with more threads than this machine has."""
    rng = random.Random(7)
    torch.manual_seed(7)
    lens = [rng.randint(0, 600) for _ in range(255)] + [1200]
    threads = 80
    assert ops.decode_attention_partitions(len(lens), max(lens), threads) == 2
    assert ops.decode_attention_partitions(len(lens), max(lens), 2) == 1
    cache, table, keys, values = _paged(rng, lens, 4, 2, 32, torch.float32)
    q = torch.randn(len(lens), 4, 32)
    split = _kernel(q, cache, table, lens, 0, threads)
    unsplit = _kernel(q, cache, table, lens, 0, 2)
    torch.testing.assert_close(split, unsplit, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(split.double(), _reference(q, keys, values, 0), rtol=1e-5, atol=2e-6)


def test_the_rule_splits_few_long_contexts_only() -> None:
    assert ops.decode_attention_partitions(1, 32768, 2) == 8  # four tasks per thread
    assert ops.decode_attention_partitions(1, 600, 2) == 2  # partitions of >= 256 tokens
    assert ops.decode_attention_partitions(1, 300, 2) == 1
    assert ops.decode_attention_partitions(3, 8192, 2) == 3
    assert ops.decode_attention_partitions(8, 32768, 2) == 1  # four requests per thread
    assert ops.decode_attention_partitions(1, 32768, 1) == 1
