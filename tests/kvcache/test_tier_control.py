"""The KV tier under a cache controller: tier events, operator pins, and the control
service (pin / clear / export / import over ZMQ, MAC'd chunks, CURVE)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from kvserve.kvcache import CacheEngine, CacheEngineConfig, CacheEngineKey, CacheEngineMetadata
from kvserve.kvcache.control import ControlClient, ControlError, ControlServer
from kvserve.kvcache.integrity import KeyedKVAuthenticator
from kvserve.kvcache.tier_events import TierEventSink
from kvserve.utils.zmq_curve import socket_security

LAYERS, HEADS, HEAD, CHUNK = 2, 2, 8, 16
CHUNK_BYTES = LAYERS * 2 * CHUNK * HEADS * HEAD * 4
SECRET = b"s" * 32


class Recorder(TierEventSink):
    def __init__(self) -> None:
        self.events: list[tuple[str, str, CacheEngineKey]] = []

    def stored(self, medium: str, keys: Sequence[CacheEngineKey]) -> None:
        self.events.extend(("stored", medium, k) for k in keys)

    def removed(self, medium: str, keys: Sequence[CacheEngineKey]) -> None:
        self.events.extend(("removed", medium, k) for k in keys)

    def of(self, kind: str, medium: str) -> list[CacheEngineKey]:
        return [k for e, m, k in self.events if (e, m) == (kind, medium)]


def _kv(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(LAYERS, 2, n, HEADS, HEAD, generator=torch.Generator().manual_seed(seed))


def _engine(chunks_in_cpu: int = 8, disk: Path | None = None, secret: bytes | None = None,
            model: str = "m") -> CacheEngine:  # fmt: skip
    config = CacheEngineConfig(
        chunk_size=CHUNK,
        max_local_cpu_size=chunks_in_cpu * CHUNK_BYTES,
        local_disk=None if disk is None else str(disk),
    )
    auth = KeyedKVAuthenticator(secret) if secret else None
    if auth is None:
        return CacheEngine(config, CacheEngineMetadata(model))
    return CacheEngine(config, CacheEngineMetadata(model), auth=auth)


def test_tiers_report_what_they_store_evict_and_clear(tmp_path: Path) -> None:
    engine, sink = _engine(chunks_in_cpu=2, disk=tmp_path), Recorder()
    engine.storage.attach_events(sink)
    tokens = list(range(3 * CHUNK))
    keys = [c.key for c in engine.chunks(tokens)]
    engine.store(tokens, _kv(3 * CHUNK))
    engine.flush()
    assert sink.of("stored", "cpu") == keys
    assert sink.of("removed", "cpu") == keys[:1]  # evicted for the third
    assert sink.of("stored", "disk") == keys
    engine.clear_medium("disk")
    assert sorted(sink.of("removed", "disk"), key=str) == sorted(keys, key=str)
    engine.clear_medium("cpu")
    assert sink.of("removed", "cpu") == [keys[0], keys[1], keys[2]]
    with pytest.raises(ValueError, match="tier: no 'remote' tier"):
        engine.clear_medium("remote")
    engine.close()


def test_pinned_prefix_outlives_eviction_and_unpin_spares_lookup_pins() -> None:
    engine = _engine(chunks_in_cpu=3)
    pinned = list(range(2 * CHUNK))
    o1, o2, o3 = ([1000 * k + i for i in range(CHUNK)] for k in (1, 2, 3))
    engine.store(pinned, _kv(2 * CHUNK))
    assert engine.pin_prefix([*pinned, 5], "cpu") == 2 * CHUNK
    engine.store(o1, _kv(CHUNK, seed=1))
    engine.store(o2, _kv(CHUNK, seed=2))  # a full tier: evicts o1, not the pinned chunks
    assert [engine.lookup(t) for t in (pinned, o1, o2)] == [2 * CHUNK, 0, CHUNK]
    assert engine.lookup(o2, lookup_id="req") == CHUNK  # a lookup's own pin
    assert engine.unpin_prefix(o2, "cpu") == 0  # never taken by pin_prefix: left alone
    assert engine.unpin_prefix(pinned, "cpu") == 2 * CHUNK
    assert engine.unpin_prefix(pinned, "cpu") == 0
    # Unpinned now: the next chunk evicts its coldest chunk; the lookup's pin holds o2.
    engine.store(o3, _kv(CHUNK, seed=3))
    assert [engine.lookup(t) for t in (pinned, o2, o3)] == [0, CHUNK, CHUNK]
    engine.close()


@pytest.fixture
def served() -> Iterator[tuple[CacheEngine, CacheEngine, ControlClient, ControlClient]]:
    engines = [_engine(secret=SECRET), _engine(secret=SECRET)]
    security = socket_security(SECRET)
    servers = [ControlServer(e, "tcp://127.0.0.1:*", security) for e in engines]
    clients = [ControlClient(s.address, timeout_s=5, security=security) for s in servers]
    yield engines[0], engines[1], clients[0], clients[1]
    for client in clients:
        client.close()
    for server in servers:
        server.close()
    for engine in engines:
        engine.close()


def test_move_copies_a_prefix_between_engines_sealed(
    served: tuple[CacheEngine, CacheEngine, ControlClient, ControlClient],
) -> None:
    source, target, to_source, to_target = served
    tokens = list(range(2 * CHUNK + 3))
    kv = _kv(2 * CHUNK)
    source.store(tokens, kv)
    info = to_source.info()
    assert (info.chunk_size, info.media, info.model_name) == (CHUNK, ["cpu"], "m")
    chunks = to_source.export(tokens, "cpu", ())
    assert [(c.start, c.end) for c, _ in chunks] == [(0, CHUNK), (CHUNK, 2 * CHUNK)]
    assert to_target.import_chunks(chunks, "cpu") == (2 * CHUNK, 0)
    assert to_target.inventory() == {"cpu": [bytes.fromhex(c.key.chunk_hash) for c in
                                            target.chunks(tokens)]}  # fmt: skip
    result = target.retrieve(tokens)
    assert result.num_tokens == 2 * CHUNK and torch.equal(result.kv(), kv)
    # A changed byte fails the MAC; another engine's secret, or model, is refused too.
    tampered = bytearray(chunks[1][1])
    tampered[-1] ^= 1
    chunks[1] = (chunks[1][0], tampered)
    target.clear()
    assert to_target.import_chunks(chunks, "cpu") == (CHUNK, 1)
    stranger = _engine(secret=b"t" * 32, model="other")
    stranger_server = ControlServer(stranger, "tcp://127.0.0.1:*", socket_security(SECRET))
    with ControlClientFor(stranger_server) as to_stranger:
        assert to_stranger.import_chunks(chunks[:1], "cpu") == (0, 1)
    stranger_server.close()
    stranger.close()
    # Pin and clear through the service; a tier it lacks is the instance's ValueError.
    assert to_source.pin(tokens, "cpu", ()) == 2 * CHUNK
    assert to_source.pin(tokens, "cpu", (), unpin=True) == 2 * CHUNK
    to_source.clear("cpu")
    assert source.lookup(tokens) == 0
    with pytest.raises(ControlError, match="ValueError: tier: no 'disk' tier"):
        to_source.pin(tokens, "disk", ())


class ControlClientFor:
    def __init__(self, server: ControlServer) -> None:
        self.client = ControlClient(server.address, timeout_s=5, security=socket_security(SECRET))

    def __enter__(self) -> ControlClient:
        return self.client

    def __exit__(self, *exc: object) -> None:
        self.client.close()


def test_a_client_without_the_secret_is_refused(
    served: tuple[CacheEngine, CacheEngine, ControlClient, ControlClient],
) -> None:
    _, _, to_source, _ = served
    plain = ControlClient(to_source.endpoint, timeout_s=0.5)
    try:
        with pytest.raises(ControlError, match="did not answer"):
            plain.clear("cpu")
    finally:
        plain.close()
    assert to_source.info().chunk_size == CHUNK  # the keyed client still is served
