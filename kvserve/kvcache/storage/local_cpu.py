"""LocalCPUBackend: chunks in process memory, bounded in bytes, evicted least recently used.

Pinned chunks (held by a lookup until its retrieve or release) are never evicted; a put
that cannot fit without evicting a pinned chunk is dropped.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from kvserve.kvcache import serde
from kvserve.kvcache.key import CacheEngineKey
from kvserve.kvcache.stats import CacheStats
from kvserve.kvcache.storage.base import StorageBackend
from kvserve.kvcache.storage.pins import PinCounts

_Entry = torch.Tensor | tuple[serde.ChunkMeta, serde.Buffer]


def _nbytes(entry: _Entry) -> int:
    if isinstance(entry, torch.Tensor):
        return entry.numel() * entry.element_size()
    return len(entry[1])


class LocalCPUBackend(StorageBackend):
    name = "cpu"
    medium = "cpu"

    def __init__(self, max_bytes: int, stats: CacheStats, serde_name: str = "raw") -> None:
        super().__init__(stats)
        self.max_bytes = max_bytes
        self.serde = serde_name
        self._lock = threading.Lock()
        self._entries: OrderedDict[CacheEngineKey, _Entry] = OrderedDict()
        self._pins: PinCounts[CacheEngineKey] = PinCounts()
        self.used_bytes = 0

    def contains(self, key: CacheEngineKey) -> bool:
        with self._lock:
            return key in self._entries

    def held_keys(self) -> list[CacheEngineKey]:
        with self._lock:
            return list(self._entries)

    def pin(self, key: CacheEngineKey) -> bool:
        with self._lock:
            if key not in self._entries:
                return False
            self._pins.add(key)
            return True

    def unpin(self, key: CacheEngineKey) -> None:
        with self._lock:
            self._pins.release(key)

    def get(self, key: CacheEngineKey) -> torch.Tensor | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
        if entry is None:
            self.stats.add(self.name, misses=1)
            return None
        self.stats.add(self.name, hits=1, bytes_retrieved=_nbytes(entry))
        return entry if isinstance(entry, torch.Tensor) else serde.decode(*entry)

    def put(self, key: CacheEngineKey, kv: torch.Tensor) -> None:
        entry: _Entry = kv if self.serde == "raw" else serde.encode(kv, self.serde)
        size = _nbytes(entry)
        evicted: list[CacheEngineKey] = []
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
            if size > self.max_bytes:
                return
            evictable = sum(_nbytes(e) for k, e in self._entries.items() if k not in self._pins)
            if self.used_bytes - evictable + size > self.max_bytes:
                self.stats.add(self.name, errors=1)
                return  # only pinned chunks are left to evict: drop this write
            # Evict from the cold end, skipping pinned chunks, until the new one fits.
            victims = iter(list(self._entries))
            while self.used_bytes + size > self.max_bytes:
                victim = next(victims)
                if victim in self._pins:
                    continue
                self.used_bytes -= _nbytes(self._entries.pop(victim))
                evicted.append(victim)
            self._entries[key] = entry
            self.used_bytes += size
        self.stats.add(self.name, bytes_stored=size, evictions=len(evicted))
        if evicted:
            self.events.removed(self.medium, evicted)
        self.events.stored(self.medium, [key])

    def remove(self, key: CacheEngineKey) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self.used_bytes -= _nbytes(entry)
        if entry is not None:
            self.events.removed(self.medium, [key])

    def clear(self) -> None:
        with self._lock:
            dropped = list(self._entries)
            self._entries.clear()
            self._pins.clear()
            self.used_bytes = 0
        if dropped:
            self.events.removed(self.medium, dropped)

    def held_bytes(self) -> int:
        """Bytes of every value held, measured from the values themselves (for tests)."""
        with self._lock:
            return sum(_nbytes(e) for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)
