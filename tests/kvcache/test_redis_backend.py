"""The Redis tier against a real redis-server that the test starts and stops."""

from __future__ import annotations

import time

import redis
import torch

from kvserve.kvcache import CacheEngine, CacheEngineConfig, CacheEngineMetadata
from kvserve.kvcache.stats import CacheStats
from kvserve.kvcache.storage.redis_backend import META_PREFIX, VALUE_PREFIX, RedisBackend
from tests.kvcache.conftest import RedisServer
from tests.kvcache.helpers import key, kv


def _backend(server: RedisServer, **kw: object) -> RedisBackend:
    return RedisBackend(
        "127.0.0.1",
        server.port,
        0,
        CacheStats(),
        reconnect_interval=0.2,
        timeout=2.0,
        **kw,  # type: ignore[arg-type]
    )


def test_put_get_and_shared_between_engines(redis_server: RedisServer) -> None:
    cfg = CacheEngineConfig(chunk_size=16, local_cpu=False, remote_url=redis_server.url)
    first = CacheEngine(cfg, CacheEngineMetadata("m"))
    second = CacheEngine(cfg, CacheEngineMetadata("m"))
    tokens = list(range(48))
    data = torch.randn(2, 2, 48, 2, 8)
    assert first.store(tokens, data) == 48
    assert second.lookup(tokens) == 48
    assert torch.equal(second.retrieve(tokens).kv(), data)
    # Another model's engine does not see these chunks.
    assert CacheEngine(cfg, CacheEngineMetadata("other")).lookup(tokens) == 0


def test_corrupt_or_truncated_value_is_a_miss(redis_server: RedisServer) -> None:
    backend = _backend(redis_server)
    raw = redis.Redis(port=redis_server.port)
    for i in range(3):
        backend.put(key(i), kv(i))
    names = [key(i).to_string() for i in range(3)]
    value = bytearray(raw.get(VALUE_PREFIX + names[0]))
    value[100] ^= 0xFF
    raw.set(VALUE_PREFIX + names[0], bytes(value))
    raw.set(VALUE_PREFIX + names[1], raw.get(VALUE_PREFIX + names[1])[:1000])
    raw.set(META_PREFIX + names[2], b"\xc1garbage")
    for i in range(3):
        assert backend.get(key(i)) is None
        assert not raw.exists(META_PREFIX + names[i])  # the bad chunk is deleted
    # Metadata missing (writer died between value and metadata): not visible at all.
    raw.set(VALUE_PREFIX + key(9).to_string(), b"x")
    assert not backend.contains(key(9)) and backend.get(key(9)) is None


def test_redis_stopped_mid_run_then_back(redis_server: RedisServer) -> None:
    backend = _backend(redis_server)
    backend.put(key(0), kv(0))
    assert backend.contains(key(0))
    redis_server.stop()
    t0 = time.monotonic()
    assert backend.get(key(0)) is None  # a miss, no exception
    assert not backend.contains(key(0))
    backend.put(key(1), kv(1))  # dropped quietly
    for _ in range(50):  # throttled: these do not even try
        assert backend.get(key(0)) is None
    assert time.monotonic() - t0 < 2.0
    assert not backend.health()
    redis_server.start()  # same port, empty (no persistence)
    time.sleep(0.3)  # past the reconnect interval
    backend.put(key(2), kv(2))
    assert torch.equal(backend.get(key(2)), kv(2))
    assert backend.health() and not backend.health_state.is_down
