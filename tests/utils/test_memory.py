"""gpu_memory_utilization's accounting on CUDA, as plain arithmetic on an H100's numbers
(torch reports 85,017,755,648 bytes in all) with Llama-3.1-8B's bfloat16 weights."""

from __future__ import annotations

import dataclasses

import pytest

from kvserve.utils.memory import (
    MemoryProfile,
    cuda_graph_estimate,
    kv_cache_budget,
    kv_cache_bytes_for_utilization,
    requested_memory,
)

H100 = MemoryProfile(
    total=85_017_755_648,
    free_at_start=84_386_201_600,  # this process's CUDA context holds the rest
    weights=16_060_522_496,
    peak_activations=1_275_068_416,
    cuda_graphs=536_870_912,
    non_torch=209_715_200,
)


def test_the_kv_cache_gets_the_share_of_the_total_less_everything_else() -> None:
    # 0.9 x 85,017,755,648 = 76,515,980,083 bytes for the instance; the rest take
    # 18,082,177,024 of them.
    assert H100.non_kv_cache == 18_082_177_024
    assert kv_cache_budget(0.9, H100) == 58_433_803_059


def test_cuda_graphs_come_out_of_the_kv_cache() -> None:
    without_graphs = dataclasses.replace(H100, cuda_graphs=0)
    assert kv_cache_budget(0.9, without_graphs) - kv_cache_budget(0.9, H100) == 536_870_912


def test_a_share_larger_than_the_free_memory_fails_at_start() -> None:
    # Another process holds 30 GiB: 0.9 of the total no longer fits, 0.5 does.
    busy = dataclasses.replace(H100, free_at_start=85_017_755_648 - (30 << 30))
    with pytest.raises(
        ValueError, match=r"gpu_memory_utilization=0.9 asks for 71.26 GiB.*only 49.18 GiB were free"
    ):
        kv_cache_budget(0.9, busy)
    assert requested_memory(0.5, busy.total, busy.free_at_start) == 42_508_877_824


def test_a_share_that_the_model_fills_leaves_no_kv_cache() -> None:
    # 0.2 gives 17,003,551,129 bytes; the weights and the rest need 18,082,177,024.
    with pytest.raises(
        ValueError,
        match=r"gpu_memory_utilization=0.2 gives this instance 15.84 GiB.*take 16.84 GiB",
    ):
        kv_cache_budget(0.2, H100)


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, True])
def test_utilization_outside_0_1_is_rejected(bad: float) -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        kv_cache_budget(bad, H100)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        kv_cache_bytes_for_utilization(bad, "cpu")


def test_graph_estimate_scales_the_smallest_capture_to_every_size() -> None:
    # vLLM's 67 default sizes up to 512: the largest's pool (which the others reuse)
    # plus what one more graph added, 66 times.
    assert cuda_graph_estimate(301_989_888, 2_097_152, 67) == 301_989_888 + 66 * 2_097_152
    assert cuda_graph_estimate(301_989_888, 0, 1) == 301_989_888
    assert cuda_graph_estimate(0, 0, 0) == 0
