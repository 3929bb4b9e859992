from __future__ import annotations

import torch

from kvserve.kvcache.stats import CacheStats
from kvserve.kvcache.storage.local_cpu import LocalCPUBackend
from tests.kvcache.helpers import CHUNK_BYTES, key, kv


def test_lru_bound_holds_under_a_workload_much_larger_than_it() -> None:
    stats = CacheStats()
    cpu = LocalCPUBackend(10 * CHUNK_BYTES + 100, stats)
    peak = 0
    for i in range(60):  # 6x the bound
        cpu.put(key(i), kv(i))
        if i % 3 == 0:
            assert cpu.get(key(0)) is not None  # keep chunk 0 hot
        peak = max(peak, cpu.held_bytes())
    assert peak <= cpu.max_bytes
    assert cpu.held_bytes() == cpu.used_bytes
    assert len(cpu) == 10
    assert torch.equal(cpu.get(key(0)), kv(0))  # recently used: kept
    assert cpu.get(key(1)) is None  # cold: evicted
    assert torch.equal(cpu.get(key(59)), kv(59))
    assert stats.tier("cpu").evictions == 50


def test_pinned_chunks_are_not_evicted() -> None:
    cpu = LocalCPUBackend(3 * CHUNK_BYTES, CacheStats())
    for i in range(3):
        cpu.put(key(i), kv(i))
    assert cpu.pin(key(0)) and cpu.pin(key(1)) and cpu.pin(key(2))
    cpu.put(key(3), kv(3))  # nothing evictable: dropped, bound kept
    assert not cpu.contains(key(3)) and cpu.used_bytes <= cpu.max_bytes
    cpu.unpin(key(1))
    cpu.put(key(4), kv(4))
    assert cpu.contains(key(0)) and cpu.contains(key(2)) and cpu.contains(key(4))
    assert not cpu.contains(key(1))
    assert not cpu.pin(key(1))  # not held: nothing to pin


def test_int8_serde_in_cpu_tier_is_smaller() -> None:
    cpu = LocalCPUBackend(1 << 20, CacheStats(), serde_name="int8")
    cpu.put(key(0), kv(0))
    assert cpu.used_bytes < CHUNK_BYTES / 3.5
    assert (cpu.get(key(0)) - kv(0)).abs().max() < 0.05
