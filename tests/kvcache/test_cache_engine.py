from __future__ import annotations

from pathlib import Path

import prometheus_client
import pytest
import torch

from kvserve.kvcache import CacheEngine, CacheEngineConfig, CacheEngineMetadata, CacheStatsCollector

LAYERS, HEADS, HEAD = 2, 2, 8


def _kv(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(LAYERS, 2, n, HEADS, HEAD, generator=torch.Generator().manual_seed(seed))


def _engine(tmp_path: Path | None = None, **kw: object) -> CacheEngine:
    cfg = CacheEngineConfig(
        chunk_size=16,
        local_disk=str(tmp_path) if tmp_path else None,
        **kw,  # type: ignore[arg-type]
    )
    return CacheEngine(cfg, CacheEngineMetadata("test-model"))


def test_store_lookup_retrieve_full_chunks_only() -> None:
    engine = _engine()
    tokens = list(range(40))
    kv = _kv(40)
    assert engine.store(tokens, kv) == 32  # two full chunks; the 8-token tail is not saved
    assert engine.lookup(tokens) == 32
    assert engine.lookup(tokens[:20]) == 16
    assert engine.lookup([7, *tokens[1:]]) == 0
    result = engine.retrieve(tokens)
    assert result.num_tokens == 32
    assert torch.equal(result.kv(), kv[:, :, :32])
    assert engine.retrieve(tokens, max_tokens=31).num_tokens == 16


def test_save_unfull_chunk_and_store_from_an_offset() -> None:
    engine = _engine(save_unfull_chunk=True)
    tokens = list(range(40))
    kv = _kv(40)
    assert engine.store(tokens, kv[:, :, :16]) == 16
    # The caller stores only the KV past what the tier already holds.
    assert engine.store(tokens, kv[:, :, 16:], start=16) == 24
    assert engine.lookup(tokens) == 40
    assert torch.equal(engine.retrieve(tokens).kv(), kv)
    with pytest.raises(ValueError, match="multiple of chunk_size"):
        engine.store(tokens, kv[:, :, 5:], start=5)


def test_lookup_pins_until_retrieve_or_release() -> None:
    chunk_bytes = LAYERS * 2 * 16 * HEADS * HEAD * 4
    engine = _engine(max_local_cpu_size=3 * chunk_bytes)
    a, b = list(range(48)), list(range(1000, 1048))
    engine.store(a, _kv(48, 1))
    assert engine.lookup(a, lookup_id="req-a") == 48
    engine.store(b, _kv(48, 2))  # would evict a's chunks, but they are pinned
    assert engine.lookup(a) == 48 and engine.lookup(b) == 0
    engine.retrieve(a, lookup_id="req-a")  # retrieve releases the pins
    assert engine.num_pinned_lookups() == 0
    engine.store(b, _kv(48, 2))
    assert engine.lookup(b) == 48 and engine.lookup(a) == 0
    # release() of an id whose request never retrieved (aborted) unpins too.
    assert engine.lookup(b, lookup_id="req-b") == 48
    engine.release("req-b")
    engine.release("req-b")  # idempotent
    assert engine.num_pinned_lookups() == 0


def test_disk_hit_is_promoted_to_cpu_and_prefetch(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    tokens = list(range(64))
    kv = _kv(64)
    engine.store(tokens, kv)
    engine.flush()
    engine.storage.cpu.clear()
    assert engine.lookup(tokens) == 64  # the disk tier holds them
    assert torch.equal(engine.retrieve(tokens[:32]).kv(), kv[:, :, :32])
    assert engine.storage.cpu.contains(engine.chunks(tokens)[0].key)  # promoted
    assert engine.prefetch(tokens).result(timeout=30) == 64
    assert len(engine.storage.cpu) == 4
    engine.close()


def test_stats_and_prometheus_collector(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    tokens = list(range(32))
    engine.store(tokens, _kv(32))
    engine.flush()
    engine.retrieve(tokens)
    engine.retrieve([5] * 32)
    registry = prometheus_client.CollectorRegistry()
    registry.register(CacheStatsCollector(engine.stats))
    text = prometheus_client.generate_latest(registry).decode()
    assert 'kvserve:kvcache_hits_total{tier="cpu"} 2.0' in text
    assert 'kvserve:kvcache_misses_total{tier="disk"} 1.0' in text
    assert "kvserve:kvcache_retrieve_seconds_count 2.0" in text
    assert 'kvserve:kvcache_bytes_stored_total{tier="disk"}' in text
    assert engine.health() == {"cpu": True, "disk": True}
    engine.close()
