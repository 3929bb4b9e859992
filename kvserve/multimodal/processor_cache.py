"""ProcessorCache: processed multimodal items by content hash, in the front end and,
mirrored, in the engine core (vLLM's sender / receiver processor caches).

The front end keeps each processed item (pixel values after resizing, normalising and
Pan-and-Scan) under its hash, so a repeated image is neither processed again nor sent
again: a hit crosses the socket as its hash alone (``MultiModalFeatureSpec.data`` None).
The engine core keeps a cache of the same capacity and applies the same operations in the
same order (messages on the socket are ordered), so both evict the same entries at the
same moment and the core always holds what the front end believes it holds.

The protocol per feature, on both sides, in request order: if the hash is cached, touch
it (most recently used); else insert it, evicting least recently used entries until it
fits. The front end runs it in ``commit``, after a request passed every check, just
before the request is sent; the core runs it in ``receive``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import msgspec

from kvserve.protocol.mm_inputs import MultiModalFeatureSpec, TensorData

ItemData = dict[str, TensorData]


def _nbytes(data: ItemData) -> int:
    return sum(t.nbytes for t in data.values())


class ProcessorCache:
    """An LRU of processed items bounded in bytes (0 capacity: nothing is cached)."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"processor cache capacity must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._items: OrderedDict[str, ItemData] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.queries = 0

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._items

    def __len__(self) -> int:
        return len(self._items)

    def peek(self, mm_hash: str) -> ItemData | None:
        """The item without changing the eviction order (the front end's lookup while a
        request may still fail its checks)."""
        return self._items.get(mm_hash)

    def _touch_or_put(self, mm_hash: str, data: ItemData | None) -> ItemData | None:
        """The protocol step: returns the cached data on a hit, None after inserting."""
        self.queries += 1
        cached = self._items.get(mm_hash)
        if cached is not None:
            self._items.move_to_end(mm_hash)
            self.hits += 1
            return cached
        if data is None:
            raise ValueError(
                f"multimodal item {mm_hash[:16]} arrived without data and is not in the "
                "processor cache (front end and engine core caches out of sync)"
            )
        size = _nbytes(data)
        if size > self.capacity_bytes:
            return None  # too large to cache: it always travels with its data
        while self.nbytes + size > self.capacity_bytes:
            _, evicted = self._items.popitem(last=False)
            self.nbytes -= _nbytes(evicted)
        self._items[mm_hash] = data
        self.nbytes += size
        return None

    def commit(self, features: Sequence[MultiModalFeatureSpec]) -> list[MultiModalFeatureSpec]:
        """Front end: the features to send, hits without their data."""
        out = []
        for feature in features:
            assert feature.data is not None, "the front end sends processed items"
            hit = self._touch_or_put(feature.identifier, feature.data) is not None
            out.append(msgspec.structs.replace(feature, data=None) if hit else feature)
        return out

    def receive(self, features: Sequence[MultiModalFeatureSpec]) -> list[MultiModalFeatureSpec]:
        """Engine core: the features with their data filled in from the mirror."""
        out = []
        for feature in features:
            cached = self._touch_or_put(feature.identifier, feature.data)
            if feature.data is None:
                assert cached is not None
                feature = msgspec.structs.replace(feature, data=cached)
            out.append(feature)
        return out
