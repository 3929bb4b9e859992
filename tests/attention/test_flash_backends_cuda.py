"""FlashAttention and FlashInfer compiled on a CUDA GPU, in bfloat16, against the CPU
backend in float32 (same rounded inputs). Skipped, naming why, without CUDA or without
the backend's wheel."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip(
        "needs a CUDA device (FlashAttention / FlashInfer kernels)", allow_module_level=True
    )

from kvserve.attention.backends.flash_attn import FlashAttentionBackend, flash_attn_package
from kvserve.attention.backends.flashinfer import FlashInferBackend
from kvserve.attention.backends.registry import get_attn_backend
from tests.attention.triton_cases import Case, run_case

FLASH = pytest.mark.skipif(
    flash_attn_package() is None, reason="needs vllm-flash-attn or flash-attn installed"
)
FLASHINFER = pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None,
    reason="needs flashinfer-python installed",
)
BACKENDS = [
    pytest.param(FlashAttentionBackend, marks=FLASH, id="FLASH_ATTN"),
    pytest.param(FlashInferBackend, marks=FLASHINFER, id="FLASHINFER"),
]
QUERY_LENS = [1] * 12 + [300, 77, 1]
COMPUTED = [1000, 37, 513, 4, 2047, 700, 90, 1, 1200, 64, 300, 999, 0, 900, 1536]


@FLASH
def test_flash_attn_is_cudas_default_where_installed() -> None:
    assert get_attn_backend("cuda") is FlashAttentionBackend


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "case",
    [
        Case(32, 8, 64, block_size=16, cache_dtype=torch.bfloat16),
        Case(16, 8, 128, block_size=16, cache_dtype=torch.bfloat16),
        Case(4, 1, 256, block_size=16, window=512, cache_dtype=torch.bfloat16),
        Case(8, 4, 128, block_size=16, soft_cap=30.0, cache_dtype=torch.bfloat16),
    ],
    ids=str,
)
def test_matches_the_cpu_backend_in_bfloat16(backend: type, case: Case) -> None:
    run_case(case, QUERY_LENS, COMPUTED, seed=1, device="cuda", atol=2e-2,
             backend_under_test=backend, dtype=torch.bfloat16)  # fmt: skip
