"""CacheServerBackend: the remote tier on a `kvserve cache-server` (kvserve://host:port).

One blocking TCP connection, guarded by a lock, opened lazily and dropped on any error.
Every failure or timeout is a miss; after one, calls are skipped for the reconnect interval.
With a KV secret the values are sealed here (payload then a MAC over key, metadata and
payload) and opened here: the server stores them as opaque bytes and needs no secret. One
that fails its MAC is a miss counted in auth_failures, and deleted.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

import torch

from kvserve.kvcache import serde
from kvserve.kvcache.integrity import PLAIN, KVAuthenticator
from kvserve.kvcache.key import CacheEngineKey
from kvserve.kvcache.server.wire import ProtocolError, recv_reply, send_request
from kvserve.kvcache.stats import CacheStats
from kvserve.kvcache.storage.base import RemoteHealth, StorageBackend

MAX_REPLY_PAYLOAD = 1 << 32


class CacheServerBackend(StorageBackend):
    name = "cache_server"

    def __init__(
        self,
        host: str,
        port: int,
        stats: CacheStats,
        serde_name: str = "raw",
        timeout: float = 5.0,
        reconnect_interval: float = 1.0,
        auth_token: str | None = None,
        auth: KVAuthenticator = PLAIN,
    ) -> None:
        super().__init__(stats)
        self.host, self.port = host, port
        self.auth_token = auth_token
        self.serde = serde_name
        self.auth = auth
        self.timeout = timeout
        self.health_state = RemoteHealth(f"kvserve://{host}:{port}", reconnect_interval)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None

    def _request(
        self, header: dict[str, Any], payload: serde.Buffer = b""
    ) -> tuple[dict[str, Any], bytearray] | None:
        if not self.health_state.should_try():
            return None
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = self._connect()
                send_request(self._sock, header, payload)
                reply = recv_reply(self._sock, MAX_REPLY_PAYLOAD)
            except (OSError, ProtocolError) as exc:
                self._close_locked()
                self.health_state.failed(exc)
                self.stats.add(self.name, errors=1)
                return None
        self.health_state.succeeded()
        if reply[0].get("status") == "error":
            self.stats.add(self.name, errors=1)
        return reply

    def _connect(self) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.auth_token is not None:
            send_request(sock, {"op": "AUTH", "token": self.auth_token})
            reply, _ = recv_reply(sock, 0)
            if reply.get("status") != "ok":
                sock.close()
                raise ProtocolError(f"the cache server refused the token: {reply.get('error')}")
        return sock

    def _close_locked(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def _ok(self, header: dict[str, Any], check: Callable[[dict[str, Any]], bool]) -> bool:
        reply = self._request(header)
        return reply is not None and reply[0].get("status") == "ok" and check(reply[0])

    def contains(self, key: CacheEngineKey) -> bool:
        return self._ok({"op": "EXISTS", "key": key.to_string()}, lambda r: bool(r.get("exists")))

    def get(self, key: CacheEngineKey) -> torch.Tensor | None:
        reply = self._request({"op": "GET", "key": key.to_string()})
        if reply is None or reply[0].get("status") != "ok":
            self.stats.add(self.name, misses=1)
            return None
        header, blob = reply
        try:
            meta = serde.ChunkMeta.from_dict(header.get("meta"))
            payload = serde.open_chunk(
                self.auth, key.to_string(), meta, blob, self.health_state.name
            )
            kv = None if payload is None else serde.decode(meta, payload)
        except ValueError:
            self.remove(key)
            self.stats.add(self.name, misses=1, errors=1)
            return None
        if kv is None:
            self.remove(key)
            self.stats.add(self.name, misses=1, auth_failures=1)
            return None
        self.stats.add(self.name, hits=1, bytes_retrieved=len(blob))
        return kv

    def put(self, key: CacheEngineKey, kv: torch.Tensor) -> None:
        name = key.to_string()
        meta, plain = serde.encode(kv, self.serde)
        payload = serde.seal_chunk(self.auth, name, meta, plain)
        header = {"op": "PUT", "key": name, "meta": meta.to_dict()}
        reply = self._request(header, payload)
        if reply is not None and reply[0].get("status") == "ok":
            self.stats.add(self.name, bytes_stored=len(payload))
            self.events.stored(self.medium, [key])

    def remove(self, key: CacheEngineKey) -> None:
        self._request({"op": "DELETE", "key": key.to_string()})

    def clear(self) -> None:
        # The server is shared by every instance; one instance does not wipe it.
        pass

    def health(self) -> bool:
        reply = self._request({"op": "HEALTH"})
        return reply is not None and reply[0].get("status") == "ok"

    def server_health(self) -> dict[str, Any] | None:
        reply = self._request({"op": "HEALTH"})
        return None if reply is None else reply[0]

    def close(self) -> None:
        with self._lock:
            self._close_locked()
