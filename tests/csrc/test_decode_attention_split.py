"""Paged decode attention and its split-K (csrc/decode_attention.cpp,
csrc/decode_attention_split.cpp): a long context is cut into partitions whose bounds
depend on the request's own context only, attended on whichever threads and merged by
log-sum-exp in a fixed order. Outputs must equal a float64 reference up to float32
rounding, and be the same bit for bit on any number of threads and in any batch."""

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
        one.double(), _reference(q, keys, values, window), rtol=1e-5, atol=2e-6
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
    assert ops.decode_attention_partitions(3000) == 11
    assert ops.decode_attention_partitions(4096) == 16
    assert ops.decode_attention_partitions(1 << 20) == 16  # at most 16
