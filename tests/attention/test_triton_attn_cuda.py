"""The Triton backend compiled on a CUDA GPU: the interpreter tests' cases (tests/
attention/test_triton_attn.py) plus realistic sizes, against the CPU backend on the
host. Skipped, with the reason named, on a machine without CUDA or without Triton."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip(
        "needs a CUDA device (Triton kernels compiled for the GPU)", allow_module_level=True
    )

from kvserve.attention.backends.flash_attn import flash_attn_package
from kvserve.attention.backends.registry import get_attn_backend
from kvserve.attention.backends.triton_attn import TritonAttentionBackend
from tests.attention.triton_cases import Case, run_case

QUERY_LENS = [1, 5, 1, 7, 1, 12]
COMPUTED = [6, 0, 13, 9, 40, 33]


def test_cuda_selects_triton() -> None:
    # FlashAttention comes first where its wheel is installed (test_flash_backends_cuda.py).
    if flash_attn_package() is None:
        assert get_attn_backend("cuda") is TritonAttentionBackend
    assert get_attn_backend("cuda", "TRITON") is TritonAttentionBackend


@pytest.mark.parametrize("block_size", [4, 5, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (6, 2), (8, 1)])
def test_mixed_batch(block_size: int, num_heads: int, num_kv_heads: int) -> None:
    case = Case(num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size)
    run_case(case, QUERY_LENS, COMPUTED, seed=block_size + num_heads, device="cuda")


@pytest.mark.parametrize(
    "case",
    [
        Case(num_heads=6, num_kv_heads=2, window=8),
        Case(num_heads=6, num_kv_heads=2, window=8, sinks=4),
        Case(num_heads=6, num_kv_heads=2, chunk=16),
        Case(num_heads=6, num_kv_heads=2, soft_cap=5.0),
        Case(num_heads=4, num_kv_heads=2, head_size=12),
        Case(num_heads=4, num_kv_heads=2, cache_dtype=torch.float16),
        Case(num_heads=4, num_kv_heads=2, causal=False),
    ],
    ids=str,
)
def test_variants(case: Case) -> None:
    run_case(case, QUERY_LENS, COMPUTED, seed=7, device="cuda")


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_size", "window"),
    [(32, 8, 64, None), (14, 2, 64, None), (16, 8, 128, None), (4, 1, 256, 512)],
)
def test_realistic_sizes(
    num_heads: int, num_kv_heads: int, head_size: int, window: int | None
) -> None:
    """Llama-3.2-1B, Qwen2.5-0.5B, Qwen3-0.6B and Gemma-3-270M (local layers) shaped
    heads on long ragged batches: 16-token blocks, contexts past a thousand keys."""
    case = Case(num_heads, num_kv_heads, head_size, block_size=16, window=window)
    query_lens = [1] * 12 + [300, 77, 1]
    computed = [1000, 37, 513, 4, 2047, 700, 90, 1, 1200, 64, 300, 999, 0, 900, 1536]
    run_case(case, query_lens, computed, seed=num_heads, device="cuda", atol=2e-5)


@pytest.mark.parametrize("window", [None, 1024])
def test_long_decodes_take_split_kv(window: int | None) -> None:
    """Two long decodes: few programs, so the backend splits their keys (choose_num_splits)."""
    case = Case(16, 8, 128, block_size=16, window=window)
    run_case(case, [1, 1], [3000, 1500], seed=3, device="cuda", atol=2e-5)
