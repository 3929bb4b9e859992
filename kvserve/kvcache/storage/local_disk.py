"""LocalDiskBackend: the disk tier. Writes go to a writer thread, off the request path.

Queued writes are bounded in bytes; when the writer falls behind, new writes are dropped
(counted as errors) rather than blocking a request. A chunk is visible to contains() and
get() once its file is in place; flush() waits for the queue to drain. With a KV secret
the files are sealed (a MAC over key, metadata and bytes): the directory may be a mount
other hosts write, and the MAC costs ~0.2 ms per MiB read against the file read itself.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import cast

import torch

from kvserve.kvcache import serde
from kvserve.kvcache.integrity import PLAIN, KVAuthenticator
from kvserve.kvcache.key import CacheEngineKey
from kvserve.kvcache.stats import CacheStats
from kvserve.kvcache.storage.base import StorageBackend
from kvserve.kvcache.storage.disk_store import DiskStore

logger = logging.getLogger(__name__)

_STOP = object()


class LocalDiskBackend(StorageBackend):
    name = "disk"
    medium = "disk"

    def __init__(
        self,
        directory: str,
        max_bytes: int,
        stats: CacheStats,
        serde_name: str = "raw",
        max_pending_bytes: int = 1 << 30,
        auth: KVAuthenticator = PLAIN,
    ) -> None:
        super().__init__(stats)
        self.store = DiskStore(directory, max_bytes)
        self.auth = auth
        self.source = f"the disk tier {directory}"
        self.serde = serde_name
        self.max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0
        self._pending_keys: set[CacheEngineKey] = set()
        self._cond = threading.Condition()
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._writer = threading.Thread(
            target=self._write_loop, name="kvcache-disk-writer", daemon=True
        )
        self._writer.start()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            key, kv = cast("tuple[CacheEngineKey, torch.Tensor]", item)
            size = kv.numel() * kv.element_size()
            try:
                evictions, failures = self.store.evictions, self.store.write_errors
                name = key.to_string()
                meta, payload = serde.encode(kv, self.serde)
                blob = serde.seal_chunk(self.auth, name, meta, payload)
                written = self.store.write(name, meta, blob)
                self.stats.add(
                    self.name,
                    bytes_stored=written,
                    evictions=self.store.evictions - evictions,
                    errors=self.store.write_errors - failures,
                )
                evicted = self.store.take_evicted()
                if evicted:
                    self.events.removed(
                        self.medium, [CacheEngineKey.from_string(k) for k in evicted]
                    )
                if written:
                    self.events.stored(self.medium, [key])
            except Exception:  # the writer thread must survive any one bad write
                logger.exception("KV disk write failed for %s", key)
                self.stats.add(self.name, errors=1)
            finally:
                with self._cond:
                    self._pending_bytes -= size
                    self._pending_keys.discard(key)
                    self._cond.notify_all()

    def put(self, key: CacheEngineKey, kv: torch.Tensor) -> None:
        size = kv.numel() * kv.element_size()
        with self._cond:
            if key in self._pending_keys or self.store.contains(key.to_string()):
                return
            if self._pending_bytes + size > self.max_pending_bytes:
                self.stats.add(self.name, errors=1)
                return
            self._pending_bytes += size
            self._pending_keys.add(key)
        self._queue.put((key, kv))

    def flush(self, timeout: float | None = None) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._pending_keys, timeout=timeout)

    def contains(self, key: CacheEngineKey) -> bool:
        return self.store.contains(key.to_string())

    def held_keys(self) -> list[CacheEngineKey]:
        return [CacheEngineKey.from_string(k) for k in self.store.keys()]

    def pin(self, key: CacheEngineKey) -> bool:
        return self.store.pin(key.to_string())

    def unpin(self, key: CacheEngineKey) -> None:
        self.store.unpin(key.to_string())

    def get(self, key: CacheEngineKey) -> torch.Tensor | None:
        corrupt = self.store.corrupt_reads
        found = self.store.read(key.to_string())
        if found is None:
            # A file that failed its checksum is an error as well as a miss, as in Redis.
            self.stats.add(self.name, misses=1, errors=self.store.corrupt_reads - corrupt)
            return None
        meta, blob = found
        payload = serde.open_chunk(self.auth, key.to_string(), meta, blob, self.source)
        if payload is None:
            self.remove(key)
            self.stats.add(self.name, misses=1, auth_failures=1)
            return None
        try:
            kv = serde.decode(meta, payload)
        except ValueError as exc:
            logger.warning("KV chunk %s on disk does not decode (%s); a miss", key, exc)
            self.remove(key)
            self.stats.add(self.name, misses=1, errors=1)
            return None
        self.stats.add(self.name, hits=1, bytes_retrieved=len(payload))
        return kv

    def remove(self, key: CacheEngineKey) -> None:
        held = self.store.contains(key.to_string())
        self.store.remove(key.to_string())
        if held:
            self.events.removed(self.medium, [key])

    def clear(self) -> None:
        self.flush()
        keys = self.store.keys()
        self.store.clear()
        if keys:
            self.events.removed(self.medium, [CacheEngineKey.from_string(k) for k in keys])

    @property
    def used_bytes(self) -> int:
        return self.store.used_bytes

    def close(self) -> None:
        self.flush()
        self._queue.put(_STOP)
        self._writer.join(timeout=10)
