"""Weights and KV cache memory on transparent huge pages (utils/huge_pages.py)."""

from __future__ import annotations

import gc
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from kvserve.utils.huge_pages import (
    HUGE_PAGE_BYTES,
    MIN_MOVE_BYTES,
    anon_huge_bytes,
    huge_page_zeros,
    live_regions,
    module_tensors,
    move_to_huge_pages,
    thp_enabled,
)
from kvserve.worker.kv_cache_specs import zeroed_tensor


def test_huge_page_zeros_are_zero_aligned_and_writable() -> None:
    region = huge_page_zeros(3 * HUGE_PAGE_BYTES + 100)
    assert region.dtype == torch.uint8 and region.numel() == 3 * HUGE_PAGE_BYTES + 100
    assert region.data_ptr() % HUGE_PAGE_BYTES == 0
    assert int(region.count_nonzero()) == 0
    region.fill_(7)
    assert int(region.sum()) == 7 * region.numel()


@pytest.mark.skipif(not thp_enabled(), reason="the kernel has transparent huge pages off")
def test_touched_memory_is_on_huge_pages() -> None:
    region = huge_page_zeros(4 * HUGE_PAGE_BYTES)
    region.fill_(1)
    assert anon_huge_bytes(region.data_ptr()) >= 2 * HUGE_PAGE_BYTES


def test_kv_cache_memory_is_zero_and_on_huge_page_memory() -> None:
    cache = zeroed_tensor((2, 64, 16, 2, 64), torch.float32, torch.device("cpu"))
    assert cache.shape == (2, 64, 16, 2, 64) and not cache.any()
    assert cache.data_ptr() % HUGE_PAGE_BYTES == 0


@dataclass
class _Planes:
    qs: torch.Tensor
    scales: torch.Tensor


class _Layer(torch.nn.Module):
    table: torch.Tensor

    def __init__(self, shared: torch.nn.Parameter) -> None:
        super().__init__()
        self.shared = shared
        self.weight = torch.nn.Parameter(torch.randn(512, 1024), requires_grad=False)
        self.register_buffer("table", torch.randn(1024, 256))
        self.small = torch.nn.Parameter(torch.randn(8, 8), requires_grad=False)
        self.planes = _Planes(
            torch.randint(0, 255, (2048, 1024), dtype=torch.uint8), torch.randn(4)
        )
        self.half_view = self.table[:512]  # another tensor object on the buffer's storage


def test_move_keeps_values_and_sharing_and_leaves_small_tensors() -> None:
    tied = torch.nn.Parameter(torch.randn(1000, 600), requires_grad=False)
    first, second = _Layer(tied), _Layer(tied)
    model = torch.nn.Sequential(first, second)
    before = {id(t): t.clone() for t in module_tensors(model)}
    small_ptr = first.small.data_ptr()
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in module_tensors(model)
    }

    moved = move_to_huge_pages(module_tensors(model))

    # Each storage of MIN_MOVE_BYTES or more once (the tied weight and the buffer's view included),
    # rounded up to 64 bytes.
    assert moved == sum(-(-n // 64) * 64 for n in storages.values() if n >= MIN_MOVE_BYTES)
    for tensor in module_tensors(model):
        assert torch.equal(tensor, before[id(tensor)])
    assert first.small.data_ptr() == small_ptr  # under MIN_MOVE_BYTES: not moved
    assert first.shared.data_ptr() == second.shared.data_ptr()  # still one tied weight
    assert first.half_view.data_ptr() == first.table.data_ptr()  # views still share
    first.table[0, 0] = 42.0
    assert first.half_view[0, 0] == 42.0
    assert isinstance(first.weight, torch.nn.Parameter)
    if thp_enabled():
        assert anon_huge_bytes(first.weight.data_ptr()) >= HUGE_PAGE_BYTES


def test_move_takes_inference_tensors() -> None:
    with torch.inference_mode():
        made = torch.randn(1024, 512)
    want = made.clone()
    assert move_to_huge_pages([made]) >= made.numel() * 4
    assert torch.equal(made, want)


_PEAK_SCRIPT = """
import resource, torch
from kvserve.utils.huge_pages import module_tensors, move_to_huge_pages
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(24)])
model.requires_grad_(False)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
moved = move_to_huge_pages(module_tensors(model))
print(moved, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


def test_move_needs_little_more_memory_than_the_model() -> None:
    """Old storages are freed (and the heap trimmed) as the copies are made: moving 400 MB
    of weights raises the process's peak by far less than another 400 MB."""
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT], capture_output=True, text=True, check=True
    ).stdout.split()
    moved, peak_growth_kb = int(out[0]), int(out[1])
    assert moved == 24 * 2048 * 2048 * 4
    assert peak_growth_kb * 1024 < moved // 4


class _SharedTable(torch.nn.Module):
    """Stands for get_rope's module: one instance in every model of its configuration."""

    shared_across_models = True

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.randn(1024, 512)


def test_a_model_gone_leaves_no_region_behind() -> None:
    """A tensor that outlives its model (a shared module's, or one moved already) must not
    pin the model's region: each model's region is unmapped when the model goes."""
    shared = _SharedTable()
    first = torch.nn.Sequential(torch.nn.Linear(512, 512), shared).requires_grad_(False)
    assert move_to_huge_pages(module_tensors(first)) > 0
    first_region = first[0].weight.untyped_storage().data_ptr()
    table_ptr = shared.table.data_ptr()
    assert first_region in live_regions()
    assert move_to_huge_pages(module_tensors(first)) == 0  # everything moved already
    second = torch.nn.Sequential(torch.nn.Linear(512, 512), shared).requires_grad_(False)
    move_to_huge_pages(module_tensors(second))
    second_region = second[0].weight.untyped_storage().data_ptr()
    assert shared.table.data_ptr() == table_ptr  # the shared module's table stays put
    del first
    gc.collect()
    assert first_region not in live_regions()
    del second
    gc.collect()
    assert second_region not in live_regions()
