"""The lookup service over TCP (ranks on other machines) with the session's KV secret: a
client holding it gets the engine's answers over CURVE; a client with another secret, or
none, is refused in the handshake and its lookups are misses, never a hang."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvserve.kvcache import CacheEngine, CacheEngineConfig, CacheEngineMetadata
from kvserve.kvcache.lookup import LookupClient, LookupServer, lookup_address
from kvserve.utils.kv_secret import read_kv_secret
from kvserve.utils.zmq_curve import PLAIN_SOCKETS, socket_security

SECURITY = socket_security(read_kv_secret(None))
TOKENS = list(range(32))


@pytest.fixture(scope="module")
def server() -> Iterator[LookupServer]:
    engine = CacheEngine(CacheEngineConfig(chunk_size=16), CacheEngineMetadata("test-model"))
    engine.store(TOKENS, torch.randn(2, 2, 32, 2, 8))
    key = lookup_address("test-lookup-curve", 0)
    server = LookupServer.acquire(engine, key, tcp_host="127.0.0.1", security=SECURITY)
    yield server
    LookupServer.release(key)


def test_a_client_with_the_secret_is_answered_over_curve(server: LookupServer) -> None:
    assert SECURITY.encrypted and server.address.startswith("tcp://")
    client = LookupClient([server.address], timeout_s=5, security=SECURITY)
    try:
        assert client.lookup(TOKENS, None, ()) == 32
        assert client.stats()[0].lookup_requests >= 1
    finally:
        client.close()


@pytest.mark.parametrize("stranger", ["another secret", "plaintext"])
def test_a_client_without_the_secret_gets_misses(server: LookupServer, stranger: str) -> None:
    security = (
        socket_security(b"another operator's KV secret 012")
        if stranger == "another secret"
        else PLAIN_SOCKETS
    )
    client = LookupClient([server.address], timeout_s=0.3, security=security)
    try:
        assert client.lookup(TOKENS, None, ()) == 0
        assert client.stats() == []
    finally:
        client.close()
