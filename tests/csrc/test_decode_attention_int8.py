"""The int8 KV cache's decode attention kernel (csrc/decode_attention_int8.cpp): equal to a
float64 reference over the dequantized cache for 1-256 ragged requests, GQA/MQA, sliding
windows and head sizes that take the AVX-512, AVX2 and portable loops; and a request's
output bit for bit the same in any batch and on any number of threads (its split-K
partitions are cut at fixed positions). Run with ``KVSERVE_MARCH=haswell`` too for the
AVX2 build."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve import _custom_ops as ops
from kvserve.attention.backends.kv_cache_codec import SCALE_BYTES, dequantize, quantize
from tests.csrc.paged_decode import paged_cache, reference, run_kernel
from tests.kernel_support import require_kernels

require_kernels()


def _paged(
    rng: random.Random, lens: list[int], kv_heads: int, head: int
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Rows of very different magnitudes (each row's own scale must reach its scores),
    quantized, and the dequantized values (float64) the cache holds."""

    def rows(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        magnitude = torch.logspace(-2, 1, max(n, 1))[:n, None, None]
        k = quantize(torch.randn(n, kv_heads, head) * magnitude)
        v = quantize(torch.randn(n, kv_heads, head) * magnitude.flip(0))
        return k, v, dequantize(k).double(), dequantize(v).double()

    return paged_cache(rng, lens, rows, (kv_heads, head + SCALE_BYTES), torch.int8)


def _kernel(
    q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, lens: list[int], window: int,
    threads: int,
) -> torch.Tensor:  # fmt: skip
    head = cache.shape[4] - SCALE_BYTES
    return run_kernel(
        ops.cache_and_decode_attention_int8, q, cache, table, lens, window, threads, head
    )


CASES = [
    # (requests' context lengths, heads, kv heads, head size, window)
    ([5000], 32, 8, 64, 0),  # single stream, GQA: ten partitions
    ([5000, 17, 700, 0, 1, 513], 6, 2, 64, 0),  # ragged, one empty, partition edges
    ([2500, 1800, 40], 8, 2, 128, 1000),  # sliding window, cut partitions
    ([1500, 300], 8, 1, 32, 0),  # MQA
    ([1200, 90], 4, 4, 16, 600),  # one AVX-512 register per row
    ([1100, 33], 4, 2, 8, 0),  # AVX2 loops on an AVX-512 build
    ([1030, 5], 6, 3, 12, 700),  # portable loops (head size 12)
    ([7], 2, 1, 256, 0),  # a partial tile only, two passes of accumulators
]


@pytest.mark.parametrize(("lens", "heads", "kv_heads", "head", "window"), CASES)
def test_equals_the_float64_reference_on_one_and_two_threads(
    lens: list[int], heads: int, kv_heads: int, head: int, window: int
) -> None:
    rng = random.Random(len(lens) * 1000 + head)
    torch.manual_seed(sum(lens))
    cache, table, keys, values = _paged(rng, lens, kv_heads, head)
    q = torch.randn(len(lens), heads, head)
    want = reference(q, keys, values, window)
    one = _kernel(q, cache, table, lens, window, 1)
    torch.testing.assert_close(one.double(), want, rtol=1e-5, atol=2e-6)
    # The threads change who attends what, never the arithmetic.
    assert torch.equal(_kernel(q, cache, table, lens, window, 2), one)
    for r, n in enumerate(lens):
        if n == 0:
            assert torch.equal(one[r], torch.zeros_like(one[r]))


def test_256_ragged_requests_and_each_alone_give_the_same_bits() -> None:
    """Batch invariance: a request's partitions depend on its own context only."""
    rng = random.Random(5)
    torch.manual_seed(5)
    lens = [rng.randint(0, 700) for _ in range(254)] + [1600, 0]
    cache, table, keys, values = _paged(rng, lens, 2, 32)
    q = torch.randn(len(lens), 8, 32)
    batch = _kernel(q, cache, table, lens, 0, 2)
    torch.testing.assert_close(batch.double(), reference(q, keys, values, 0), rtol=1e-5, atol=2e-6)
    for r in [0, 1, 100, 254, 255]:
        alone = _kernel(q[r : r + 1], cache, table[r : r + 1], lens[r : r + 1], 0, 1)
        assert torch.equal(alone[0], batch[r])
