"""RedisBackend: the shared remote tier on a Redis server (redis-py).

Each chunk is two Redis keys: `kvserve:kv:<key>` holds the payload and `kvserve:meta:<key>`
holds msgpack metadata (shape, dtype, serde, payload_len, crc32). The value is written
before the metadata, and readers look at the metadata first, so a reader never sees a
half-written chunk. A value that does not match its metadata's length or checksum is a miss
and both keys are deleted. With a KV secret the value is sealed (payload then a MAC over
key, metadata and payload): one that fails it was planted by a writer without the secret,
a miss counted in auth_failures, and is deleted so that the next store puts the engine's
own chunk there. Every failure or timeout is a miss, never an exception; after one,
calls are skipped for remote_reconnect_interval_secs (see RemoteHealth).
"""

from __future__ import annotations

import logging
import zlib
from typing import Any

import msgspec
import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvserve.kvcache import serde
from kvserve.kvcache.integrity import PLAIN, KVAuthenticator
from kvserve.kvcache.key import CacheEngineKey
from kvserve.kvcache.stats import CacheStats
from kvserve.kvcache.storage.base import RemoteHealth, StorageBackend

logger = logging.getLogger(__name__)

VALUE_PREFIX = "kvserve:kv:"
META_PREFIX = "kvserve:meta:"


class RedisBackend(StorageBackend):
    name = "redis"

    def __init__(
        self,
        host: str,
        port: int,
        db: int,
        stats: CacheStats,
        serde_name: str = "raw",
        timeout: float = 5.0,
        reconnect_interval: float = 1.0,
        auth_token: str | None = None,
        auth: KVAuthenticator = PLAIN,
    ) -> None:
        super().__init__(stats)
        self.serde = serde_name
        self.auth = auth
        self.health_state = RemoteHealth(f"redis://{host}:{port}/{db}", reconnect_interval)
        self.client = redis.Redis(
            host=host,
            port=port,
            db=db,
            password=auth_token,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            # No client-side retries: a failure is a miss now, and RemoteHealth throttles.
            retry=Retry(NoBackoff(), 0),
        )

    def _call(self, fn: Any, default: Any) -> Any:
        if not self.health_state.should_try():
            return default
        try:
            result = fn()
        except (redis.RedisError, OSError) as exc:
            self.health_state.failed(exc)
            self.stats.add(self.name, errors=1)
            return default
        self.health_state.succeeded()
        return result

    def contains(self, key: CacheEngineKey) -> bool:
        return bool(self._call(lambda: self.client.exists(META_PREFIX + key.to_string()), False))

    def get(self, key: CacheEngineKey) -> torch.Tensor | None:
        name = key.to_string()
        # One round trip for both; the metadata decides whether the value is whole.
        found = self._call(lambda: self.client.mget(META_PREFIX + name, VALUE_PREFIX + name), None)
        if not found or found[0] is None or found[1] is None:
            self.stats.add(self.name, misses=1)
            return None
        raw_meta, payload = found
        try:
            header = msgspec.msgpack.decode(raw_meta)
            meta = serde.ChunkMeta.from_dict(header)
            if header.get("payload_len") != len(payload):
                raise ValueError(
                    f"value is {len(payload)} bytes, metadata says {header.get('payload_len')}"
                )
            if header.get("crc32") != zlib.crc32(payload):
                raise ValueError("checksum mismatch")
            opened = serde.open_chunk(self.auth, name, meta, payload, self.health_state.name)
            kv = None if opened is None else serde.decode(meta, opened)
        except (ValueError, msgspec.DecodeError) as exc:
            logger.warning("corrupt KV chunk %s in Redis (%s); deleting, a miss", name, exc)
            self._call(lambda: self.client.delete(META_PREFIX + name, VALUE_PREFIX + name), 0)
            self.stats.add(self.name, misses=1, errors=1)
            return None
        if kv is None:
            self._call(lambda: self.client.delete(META_PREFIX + name, VALUE_PREFIX + name), 0)
            self.stats.add(self.name, misses=1, auth_failures=1)
            return None
        self.stats.add(self.name, hits=1, bytes_retrieved=len(payload))
        return kv

    def put(self, key: CacheEngineKey, kv: torch.Tensor) -> None:
        name = key.to_string()
        meta, plain = serde.encode(kv, self.serde)
        payload = serde.seal_chunk(self.auth, name, meta, plain)
        header = msgspec.msgpack.encode(
            {**meta.to_dict(), "payload_len": len(payload), "crc32": zlib.crc32(payload)}
        )

        def write() -> bool:
            # Value first, metadata second: metadata present means the value is complete.
            self.client.set(VALUE_PREFIX + name, payload)
            self.client.set(META_PREFIX + name, header)
            return True

        if self._call(write, False):
            self.stats.add(self.name, bytes_stored=len(payload))
            self.events.stored(self.medium, [key])

    def remove(self, key: CacheEngineKey) -> None:
        name = key.to_string()
        self._call(lambda: self.client.delete(META_PREFIX + name, VALUE_PREFIX + name), 0)

    def clear(self) -> None:
        def drop() -> int:
            removed = 0
            for pattern in (META_PREFIX + "*", VALUE_PREFIX + "*"):
                batch = list(self.client.scan_iter(match=pattern, count=500))
                if batch:
                    removed += self.client.delete(*batch)
            return removed

        self._call(drop, 0)

    def health(self) -> bool:
        # A health check is an explicit question: it ignores the retry throttle.
        try:
            ok = bool(self.client.ping())
        except (redis.RedisError, OSError) as exc:
            self.health_state.failed(exc)
            return False
        self.health_state.succeeded()
        return ok

    def close(self) -> None:
        self.client.close()
