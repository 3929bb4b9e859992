"""`kvserve cache-server` as a real process: storage, bounds and robustness."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import msgspec
import pytest
import torch

from kvserve.kvcache.server.cli import main as cache_server_main
from kvserve.kvcache.server.wire import encode_frame, recv_reply, send_request
from kvserve.kvcache.stats import CacheStats
from kvserve.kvcache.storage.cache_server_backend import CacheServerBackend
from tests.kvcache.helpers import CHUNK_BYTES, key, kv


def _backend(server: object) -> CacheServerBackend:
    return CacheServerBackend(server.host, server.port, CacheStats(), reconnect_interval=0.2)  # type: ignore[attr-defined]


def _health(server: object) -> dict:
    with socket.create_connection((server.host, server.port), timeout=5) as s:  # type: ignore[attr-defined]
        send_request(s, {"op": "HEALTH"})
        return recv_reply(s, 1 << 20)[0]


def test_put_get_exists_delete(cache_server_factory: type) -> None:
    server = cache_server_factory()
    backend = _backend(server)
    backend.put(key(0), kv(0))
    assert backend.contains(key(0)) and not backend.contains(key(1))
    assert torch.equal(backend.get(key(0)), kv(0))
    backend.remove(key(0))
    assert backend.get(key(0)) is None
    int8 = CacheServerBackend(server.host, server.port, CacheStats(), serde_name="int8")
    int8.put(key(1), kv(1))
    assert (backend.get(key(1)) - kv(1)).abs().max() < 0.05  # any reader decodes it
    assert backend.health()


def test_memory_bound_holds_under_a_larger_workload(
    cache_server_factory: type, tmp_path: object
) -> None:
    bound = 10 * CHUNK_BYTES
    server = cache_server_factory("--max-memory", str(bound), "--spill-dir", str(tmp_path))
    backend = _backend(server)
    for i in range(50):  # 5x the bound
        backend.put(key(i), kv(i))
        assert _health(server)["used_bytes"] <= bound
    health = _health(server)
    assert health["peak_bytes"] <= bound and health["keys"] == 10
    # Evicted chunks were spilled to disk and are still served.
    assert health["spill_bytes"] > 0
    assert torch.equal(backend.get(key(0)), kv(0))
    assert torch.equal(backend.get(key(49)), kv(49))


def test_survives_malformed_oversized_and_half_closed(cache_server_factory: type) -> None:
    server = cache_server_factory("--max-memory", "1MiB")
    backend = _backend(server)
    backend.put(key(0), kv(0))
    addr = (server.host, server.port)

    def exchange(data: bytes, shut: bool = False) -> bytes:
        with socket.create_connection(addr, timeout=5) as s:
            s.sendall(data)
            if shut:
                s.shutdown(socket.SHUT_WR)
            chunks = []
            while True:
                try:
                    got = s.recv(65536)
                except (ConnectionResetError, TimeoutError):
                    break
                if not got:
                    break
                chunks.append(got)
            return b"".join(chunks)

    # Not msgpack; msgpack but not a map; a negative length; an unknown op.
    for header in (
        b"\xc1\xc1\xc1",
        msgspec.msgpack.encode([1, 2]),
        msgspec.msgpack.encode({"len": -5}),
    ):
        reply = exchange(struct.pack(">I", len(header)) + header)
        assert b"error" in reply
    assert b"unknown op" in exchange(encode_frame({"op": "FROB", "key": "k"}), shut=True)
    # A header length of 4 GiB, and a payload length far over the cap: refused, no allocation.
    assert b"exceeds the cap" in exchange(struct.pack(">I", 0xFFFFFFFF))
    assert b"exceeds the cap" in exchange(
        encode_frame({"op": "PUT", "key": "k", "meta": {}}, 1 << 40)
    )
    # Half-closed in the middle of a frame, and right after the length prefix.
    assert exchange(encode_frame({"op": "PUT", "key": "k"}, 1000) + b"x" * 10, shut=True) == b""
    assert exchange(struct.pack(">I", 50), shut=True) == b""
    # A PUT with metadata that is not KV metadata.
    assert b"bad meta" in exchange(
        encode_frame({"op": "PUT", "key": "k", "meta": {"shape": "x"}}, 3) + b"abc", shut=True
    )
    assert server.alive()
    assert torch.equal(backend.get(key(0)), kv(0))
    health = _health(server)
    assert health["status"] == "ok" and health["protocol_errors"] >= 5


def test_server_down_is_a_miss_and_back(cache_server_factory: type) -> None:
    server = cache_server_factory()
    backend = _backend(server)
    backend.put(key(0), kv(0))
    server.stop()
    assert backend.get(key(0)) is None and not backend.contains(key(0))
    backend.put(key(1), kv(1))  # quietly dropped


def test_a_server_with_a_token_refuses_clients_without_it(
    cache_server_factory: type, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    token_file.chmod(0o600)
    server = cache_server_factory("--auth-token-file", str(token_file))
    # The engine's backend with the token stores and reads.
    keyed = CacheServerBackend(server.host, server.port, CacheStats(), auth_token="s3cret-token")
    keyed.put(key(0), kv(0))
    assert torch.equal(keyed.get(key(0)), kv(0))
    # Without it, or with a wrong one, nothing is read or written: every op is a miss.
    for token in (None, "guess"):
        stranger = CacheServerBackend(
            server.host, server.port, CacheStats(), auth_token=token, reconnect_interval=0
        )
        assert stranger.get(key(0)) is None and not stranger.contains(key(0))
        stranger.put(key(1), kv(1))
        assert keyed.get(key(1)) is None
    # A raw client that skips AUTH gets an error and its connection closed.
    with socket.create_connection((server.host, server.port), timeout=5) as s:
        send_request(s, {"op": "GET", "key": key(0).to_string()})
        assert recv_reply(s, 1 << 20)[0]["status"] == "error"
        assert s.recv(1) == b""
    assert torch.equal(keyed.get(key(0)), kv(0))  # still serving its rightful client


def test_a_token_file_that_others_can_read_is_refused(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    token_file.chmod(0o644)
    with pytest.raises(SystemExit, match="readable by other users"):
        cache_server_main(["--port", "0", "--auth-token-file", str(token_file)])
