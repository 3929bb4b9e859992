from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from kvserve import _custom_ops as ops
from kvserve.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionMetadata
from kvserve.attention.backends.registry import get_attn_backend
from kvserve.attention.backends.utils import make_common_attn_metadata

NUM_HEADS, NUM_KV_HEADS, HEAD = 8, 2, 16


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, window: int | None
) -> torch.Tensor:
    """q [Lq, H, D] at positions first_pos.., k/v [S, Hkv, D] for positions 0..S-1."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        pos = first_pos + i
        lo = 0 if window is None else max(0, pos - window + 1)
        scores = torch.einsum("hd,shd->hs", q[i], k[lo : pos + 1]) * q.shape[2] ** -0.5
        out[i] = torch.einsum("hs,shd->hd", scores.softmax(-1), v[lo : pos + 1])
    return out


def run_case(
    rng: random.Random,
    block_size: int,
    query_lens: list[int],
    computed: list[int],
    window: int | None = None,
    dims: tuple[int, int, int] = (NUM_HEADS, NUM_KV_HEADS, HEAD),
    cache_dtype: torch.dtype = torch.float32,
) -> None:
    num_heads, num_kv_heads, head = dims
    seq_lens = [c + q for c, q in zip(computed, query_lens, strict=True)]
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    pool = list(range(num_blocks))
    rng.shuffle(pool)  # non-contiguous, out-of-order block ids
    tables = []
    for n in blocks_needed:
        tables.append(pool[:n])
        pool = pool[n:]

    backend = get_attn_backend("cpu")
    shape = backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head)
    kv_cache = torch.zeros(shape, dtype=cache_dtype)
    full_k = [torch.randn(s, num_kv_heads, head) for s in seq_lens]
    full_v = [torch.randn(s, num_kv_heads, head) for s in seq_lens]
    # What a narrower cache holds: each value rounded to its type.
    stored_k = [t.to(cache_dtype) for t in full_k]
    stored_v = [t.to(cache_dtype) for t in full_v]
    # Place the already-computed prefix in the cache, as earlier steps would have.
    for r, c in enumerate(computed):
        for pos in range(c):
            block, off = tables[r][pos // block_size], pos % block_size
            kv_cache[0, block, off] = full_k[r][pos]
            kv_cache[1, block, off] = full_v[r][pos]

    common = make_common_attn_metadata(query_lens, computed, tables, block_size)
    metadata = backend.get_builder_cls()(block_size, "cpu").build(common)
    q = torch.randn(sum(query_lens), num_heads, head)
    k = torch.cat([full_k[r][c:] for r, c in enumerate(computed)])
    v = torch.cat([full_v[r][c:] for r, c in enumerate(computed)])
    impl = backend.get_impl_cls()(num_heads, head, head**-0.5, num_kv_heads, window)
    # The C++ decode kernel and the torch fallback must both agree with the naive loop.
    with ops.disabled():
        out_torch = impl.forward(torch.nn.Module(), q, k, v, kv_cache, metadata)
    out = impl.forward(torch.nn.Module(), q, k, v, kv_cache, metadata)

    start = 0
    for r, q_len in enumerate(query_lens):
        expected = naive_attention(
            q[start : start + q_len], stored_k[r].float(), stored_v[r].float(), computed[r], window
        )
        for result in (out, out_torch):
            torch.testing.assert_close(
                result[start : start + q_len], expected, atol=1e-5, rtol=1e-5
            )
        start += q_len
    # This step's K/V landed in the cache at the right slots.
    for r, c in enumerate(computed):
        for pos in range(c, seq_lens[r]):
            block, off = tables[r][pos // block_size], pos % block_size
            assert torch.equal(kv_cache[0, block, off], stored_k[r][pos])
            assert torch.equal(kv_cache[1, block, off], stored_v[r][pos])


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("seed", range(4))
def test_random_mixed_batches_match_naive(block_size: int, seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_reqs = rng.randint(2, 6)
    query_lens, computed = [], []
    for _ in range(num_reqs):
        kind = rng.choice(["decode", "prefill", "chunk"])
        query_lens.append(1 if kind == "decode" else rng.randint(2, 40))
        computed.append(0 if kind == "prefill" else rng.randint(1, 50))
    run_case(rng, block_size, query_lens, computed)


def test_single_token_prefill_and_pure_decode_batch() -> None:
    rng = random.Random(7)
    run_case(rng, 4, [1, 1, 1], [0, 5, 17])


@pytest.mark.parametrize("head", [16, 12])  # 12: the portable loops, not the FMA ones
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_narrow_kv_cache_matches_naive_on_the_stored_values(
    cache_dtype: torch.dtype, head: int
) -> None:
    """--kv-cache-dtype float16/bfloat16: keys and values are rounded once, when written;
    attention over them is float32 arithmetic, so kernel and torch fallback agree with
    the naive loop run on the rounded values. Decodes, prefills, chunks and a window."""
    rng = random.Random(head)
    torch.manual_seed(head)
    dims = (6, 2, head)
    run_case(rng, 4, [1, 1, 17, 9, 1], [3, 40, 0, 12, 70], dims=dims, cache_dtype=cache_dtype)
    run_case(
        rng,
        4,
        [1] * 12,
        [rng.randint(1, 70) for _ in range(12)],
        dims=dims,
        cache_dtype=cache_dtype,
    )
    run_case(rng, 4, [1, 5], [30, 9], window=5, dims=dims, cache_dtype=cache_dtype)


@pytest.mark.parametrize("window", [1, 5, 8])
def test_sliding_window(window: int) -> None:
    rng = random.Random(window)
    torch.manual_seed(window)
    run_case(rng, 4, [1, 9, 13, 1], [20, 0, 6, 3], window=window)


def test_builder_splits_decodes_and_prefills_once_per_step() -> None:
    common = make_common_attn_metadata([3, 1, 1, 5], [0, 7, 2, 4], [[0], [1, 2], [3], [4, 5, 6]], 4)
    md = CPUAttentionBackend.get_builder_cls()(4, "cpu").build(common)
    assert isinstance(md, CPUAttentionMetadata)
    assert md.decode is not None
    assert md.decode.token_indices.tolist() == [3, 4]
    assert md.decode.key_mask.shape == (2, 8)  # padded to the longest decode (2 blocks)
    assert [(c.token_start, c.token_end) for c in md.prefills] == [(0, 3), (5, 10)]
    assert md.slot_token_indices is None


def test_negative_slots_are_skipped() -> None:
    common = make_common_attn_metadata([2], [0], [[1]], 4)
    common.slot_mapping = torch.tensor([5, -1])
    md = CPUAttentionBackend.get_builder_cls()(4, "cpu").build(common)
    kv_cache = torch.zeros(CPUAttentionBackend.get_kv_cache_shape(2, 4, NUM_KV_HEADS, HEAD))
    k = torch.ones(2, NUM_KV_HEADS, HEAD)
    impl = CPUAttentionBackend.get_impl_cls()(NUM_HEADS, HEAD, 1.0, NUM_KV_HEADS)
    impl.forward(torch.nn.Module(), torch.randn(2, NUM_HEADS, HEAD), k, k, kv_cache, md)
    assert kv_cache[0].view(-1, NUM_KV_HEADS, HEAD)[5].eq(1).all()
    assert kv_cache.sum() == 2 * NUM_KV_HEADS * HEAD


def test_backend_selection() -> None:
    assert get_attn_backend("cpu") is CPUAttentionBackend
    # CUDA picks Triton where it is installed (tests/attention/test_triton_attn.py),
    # else the device-agnostic torch backend.
    if importlib.util.find_spec("triton") is None:
        assert get_attn_backend("cuda") is CPUAttentionBackend
    else:
        assert get_attn_backend("cuda").get_name() == "TRITON"
    assert CPUAttentionBackend.get_kv_cache_shape(10, 16, 2, 64) == (2, 10, 16, 2, 64)
    # FlashAttention forced on a CPU gives way to Triton (tests/attention/test_flash_backends.py);
    # a name no backend has is an error.
    with pytest.raises(ValueError, match="not available"):
        get_attn_backend("cpu", name="NO_SUCH_BACKEND")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("num_decodes", [1, 3, 12])
@pytest.mark.parametrize("head", [16, 12])
def test_decode_kernel_task_splits_match_naive(threads: int, num_decodes: int, head: int) -> None:
    """The kernel splits a step into tasks by query head (single stream), by kv head or by
    request (large batches), depending on requests per thread; head sizes that are a
    multiple of 8 take the FMA loops, others the portable ones. All must agree."""
    rng = random.Random(num_decodes * 100 + head)
    torch.manual_seed(num_decodes)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        computed = [rng.randint(1, 70) for _ in range(num_decodes)]
        run_case(rng, 4, [1] * num_decodes, computed, dims=(6, 2, head))
        run_case(rng, 4, [1] * num_decodes, computed, window=5, dims=(6, 2, head))
    finally:
        torch.set_num_threads(before)
