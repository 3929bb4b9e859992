"""The int8 KV cache: quantization bounds, exact dequantization, the C++ kernel's writes
equal to the torch path's bytes, and paged attention over int8 blocks (kernel and torch
path) equal to a float32 reference over the dequantized values."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve import _custom_ops as ops
from kvserve.attention.backends.kv_cache_codec import (
    SCALE_BYTES,
    Int8KVCache,
    dequantize,
    quantize,
)
from kvserve.attention.backends.registry import get_attn_backend
from kvserve.attention.backends.utils import make_common_attn_metadata
from tests.attention.test_cpu_attn import naive_attention
from tests.kernel_support import require_kernels


def _rows(seed: int, n: int, d: int) -> torch.Tensor:
    """Rows of very different magnitudes (1e-3 .. 1e3), one all zero, one with an outlier."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.logspace(-3, 3, n)[:, None]
    x[0] = 0.0
    x[1, 3] = 500.0
    return x


def test_quantize_bound_and_exact_dequantize() -> None:
    x = _rows(0, 64, 48)
    packed = quantize(x)
    assert packed.dtype == torch.int8 and packed.shape == (64, 48 + SCALE_BYTES)
    scale = packed[:, 48:].view(torch.bfloat16).float()
    back = dequantize(packed)
    # q * scale is exact in float32: 8 significant bits times 8.
    assert torch.equal(back, packed[:, :48].double().mul(scale.double()).float())
    # Every value within half a step of its row's scale; the scale tracks max|x| / 127.
    assert ((back - x).abs() <= scale / 2).all()
    amax = x.abs().amax(dim=1, keepdim=True)
    assert torch.allclose(scale, amax / 127, rtol=2**-8, atol=0)
    assert torch.equal(back[0], torch.zeros(48))  # an all-zero row stays zero
    assert packed[:, :48].abs().max() <= 127


def test_a_later_larger_token_leaves_earlier_rows_unchanged() -> None:
    """Per-row scales: a block's earlier rows are never requantized (what chunked
    prefill and prefix caching rely on); the large token gets its own scale."""
    kv_cache = torch.zeros(2, 3, 4, 2, 16 + SCALE_BYTES, dtype=torch.int8)
    small = torch.randn(3, 2, 16) * 0.01
    Int8KVCache.write(small, small, kv_cache, torch.tensor([4, 5, 6]), None)
    before = kv_cache[:, 1, :3].clone()
    big = torch.randn(1, 2, 16) * 1000
    Int8KVCache.write(big, -big, kv_cache, torch.tensor([7]), None)
    assert torch.equal(kv_cache[:, 1, :3], before)
    assert ((dequantize(kv_cache[0, 1, 3]) - big[0]).abs() <= _half_step(big[0])).all()
    assert ((dequantize(kv_cache[0, 1, :3]) - small).abs() <= _half_step(small)).all()


def _half_step(x: torch.Tensor) -> torch.Tensor:
    """Half a quantization step of each row: max|x| / 127 (rounded to bfloat16) / 2."""
    return x.abs().amax(dim=-1, keepdim=True) / 127 * (1 + 2**-8) / 2


def test_kernel_writes_the_torch_paths_bytes() -> None:
    require_kernels()
    torch.manual_seed(1)
    num_blocks, block_size, heads, head = 6, 4, 3, 32
    key = torch.randn(10, heads, head) * torch.logspace(-2, 2, 10)[:, None, None]
    value = torch.randn(10, heads, head)
    key[2] = 0.0
    slots = torch.tensor([0, 5, 9, -1, 23, 1, 2, 3, 11, 17])
    ref = torch.zeros(2, num_blocks, block_size, heads, head + SCALE_BYTES, dtype=torch.int8)
    keep = torch.nonzero(slots >= 0).flatten()
    Int8KVCache.write(key, value, ref, slots[keep], keep)
    got = torch.zeros_like(ref)
    empty = torch.zeros((0, 1), dtype=torch.int32)
    ops.cache_and_decode_attention_int8(
        torch.zeros(10, heads, head), torch.zeros(10, heads, head), key, value, got, slots,
        empty, torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.long), 1.0, None,
    )  # fmt: skip
    assert torch.equal(got, ref)


def _paged_case(
    seed: int, block_size: int, query_lens: list[int], computed: list[int], window: int | None,
    heads: tuple[int, int, int],
) -> None:  # fmt: skip
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_heads, num_kv_heads, head = heads
    seq_lens = [c + q for c, q in zip(computed, query_lens, strict=True)]
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 2
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables = []
    for n in needed:
        tables.append(pool[:n])
        pool = pool[n:]
    backend = get_attn_backend("cpu")
    shape = backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head + SCALE_BYTES)
    kv_cache = torch.zeros(shape, dtype=torch.int8)
    full_k = [torch.randn(s, num_kv_heads, head) * 3 for s in seq_lens]
    full_v = [torch.randn(s, num_kv_heads, head) for s in seq_lens]
    for r, c in enumerate(computed):  # the cached prefix, as earlier steps wrote it
        slots = torch.tensor([tables[r][p // block_size] * block_size + p % block_size
                              for p in range(c)], dtype=torch.long)  # fmt: skip
        Int8KVCache.write(full_k[r][:c], full_v[r][:c], kv_cache, slots, None)
    common = make_common_attn_metadata(query_lens, computed, tables, block_size)
    metadata = backend.get_builder_cls()(block_size, "cpu").build(common)
    q = torch.randn(sum(query_lens), num_heads, head)
    k = torch.cat([full_k[r][c:] for r, c in enumerate(computed)])
    v = torch.cat([full_v[r][c:] for r, c in enumerate(computed)])
    impl = backend.get_impl_cls()(num_heads, head, head**-0.5, num_kv_heads, window)
    with ops.disabled():
        out_torch = impl.forward(torch.nn.Module(), q, k, v, kv_cache.clone(), metadata)
    out = impl.forward(torch.nn.Module(), q, k, v, kv_cache, metadata)
    start = 0
    for r, q_len in enumerate(query_lens):
        # The float32 reference over exactly what the cache holds (dequantized values)...
        deq_k, deq_v = dequantize(quantize(full_k[r])), dequantize(quantize(full_v[r]))
        want = naive_attention(q[start : start + q_len], deq_k, deq_v, computed[r], window)
        # ...and over the unquantized values, within the quantization's effect.
        exact = naive_attention(q[start : start + q_len], full_k[r], full_v[r], computed[r], window)
        for got in (out, out_torch):
            torch.testing.assert_close(got[start : start + q_len], want, rtol=1e-4, atol=1e-5)
            assert (got[start : start + q_len] - exact).abs().max() < 0.1
        start += q_len


@pytest.mark.parametrize(
    ("block_size", "query_lens", "computed", "window", "heads"),
    [
        (16, [1, 1, 1], [37, 0, 15], None, (8, 2, 64)),  # decodes, GQA
        (4, [1, 5, 1, 3], [20, 7, 0, 9], None, (4, 4, 32)),  # decodes mixed with prefills
        (8, [1, 1, 6], [50, 3, 10], 12, (6, 2, 16)),  # sliding window
        (1, [1, 2], [9, 4], None, (2, 1, 128)),  # one token per block
    ],
)
def test_paged_attention_over_int8_blocks(
    block_size: int, query_lens: list[int], computed: list[int], window: int | None,
    heads: tuple[int, int, int],
) -> None:  # fmt: skip
    _paged_case(block_size * 7 + len(query_lens), block_size, query_lens, computed, window, heads)
