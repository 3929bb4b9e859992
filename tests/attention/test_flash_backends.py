"""FlashAttention / FlashInfer on a machine without them (or without CUDA): the registry
falls back to Triton with one log line, the backends' kernels give way to Triton's per
call, and FlashInfer's page lists come out of the block table as FlashInfer reads them."""

from __future__ import annotations

import logging

import pytest
import torch

from kvserve.attention.backends import registry
from kvserve.attention.backends.flash_attn import FlashAttentionBackend, flash_attn_package
from kvserve.attention.backends.flashinfer import FlashInferBackend, FlashInferMetadata
from kvserve.attention.backends.registry import get_attn_backend, set_attention_backend
from kvserve.attention.backends.triton_attn import TritonAttentionBackend
from kvserve.attention.backends.utils import make_common_attn_metadata
from tests.attention.triton_cases import Case, run_case


@pytest.fixture(autouse=True)
def fresh_log() -> None:
    registry._log_fallback.cache_clear()


@pytest.mark.parametrize("name", ["FLASH_ATTN", "FLASHINFER"])
def test_forced_on_a_cpu_falls_back_to_triton_with_one_log_line(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger=registry.__name__):
        assert get_attn_backend("cpu", name) is TritonAttentionBackend
        assert get_attn_backend("cpu", name) is TritonAttentionBackend
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"attention backend {name} runs on CUDA only: cpu on cpu uses TRITON"]


@pytest.mark.skipif(flash_attn_package() is not None, reason="a FlashAttention wheel is installed")
def test_cuda_without_flash_packages_uses_triton(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=registry.__name__):
        assert get_attn_backend("cuda") is TritonAttentionBackend
        assert get_attn_backend("cuda", "FLASH_ATTN") is TritonAttentionBackend
    assert len(caplog.records) == 1
    assert "FLASH_ATTN needs one of the packages" in caplog.records[0].getMessage()


def test_attention_backend_names_are_checked() -> None:
    with pytest.raises(ValueError, match="attention_backend 'FLASH' is not one of"):
        set_attention_backend("FLASH")
    set_attention_backend("FLASHINFER")
    try:
        assert get_attn_backend("cpu") is TritonAttentionBackend  # forced, then fallen back
    finally:
        set_attention_backend(None)
    assert get_attn_backend("cpu").get_name() == "CPU_ATTN"


@pytest.mark.parametrize("backend", [FlashAttentionBackend, FlashInferBackend])
@pytest.mark.parametrize(
    "case", [Case(num_heads=6, num_kv_heads=2, window=8, soft_cap=5.0), Case(chunk=8, sinks=0)]
)
def test_kernels_give_way_to_triton_where_they_cannot_run(backend: type, case: Case) -> None:
    """A CPU and float32: each call runs the Triton kernel (interpreted), the CPU
    backend's output within 1e-5 and the same cache."""
    run_case(case, [1, 5, 1, 7], [6, 0, 13, 9], seed=3, device="cpu", backend_under_test=backend)


def test_flashinfer_page_lists() -> None:
    """Requests of 6, 4 and 9 tokens in 4-token pages: 2, 1 and 3 pages; the last holds 2,
    4 and 1 tokens; the indices are each row's used blocks, in order."""
    common = make_common_attn_metadata([1, 4, 9], [5, 0, 0], [[7, 3], [5], [9, 2, 6]], 4)
    md = FlashInferBackend.get_builder_cls()(4, "cpu").build(common)
    assert isinstance(md, FlashInferMetadata)
    assert md.paged_kv_indptr is not None and md.paged_kv_indices is not None
    assert md.paged_kv_last_page_len is not None
    assert md.paged_kv_indptr.tolist() == [0, 2, 3, 6]
    assert md.paged_kv_indices.tolist() == [7, 3, 5, 9, 2, 6]
    assert md.paged_kv_last_page_len.tolist() == [2, 4, 1]
    assert md.paged_kv_indices.dtype == torch.int32
