"""Tier events: which chunks a tier (cpu, disk, remote) now holds or no longer holds.

The tier knows nothing of who listens. A cache controller follows these to know which
instance holds which prefix in which tier (kvserve/distributed/tier_events.py publishes
them as KV cache events with the tier as their medium). Keys are the tier's own chunk
keys, whose chunk_hash is the deterministic chained hash of chunking.py, so a listener
that hashes the same tokens with the same seed and chunk size finds them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvserve.kvcache.key import CacheEngineKey

MEDIA = ("cpu", "disk", "remote")


class TierEventSink(ABC):
    @abstractmethod
    def stored(self, medium: str, keys: Sequence[CacheEngineKey]) -> None:
        """The tier ``medium`` now holds ``keys`` (called by any thread)."""

    @abstractmethod
    def removed(self, medium: str, keys: Sequence[CacheEngineKey]) -> None:
        """The tier ``medium`` dropped ``keys`` (evicted, removed or cleared)."""


class NullTierEventSink(TierEventSink):
    """Nobody listens: the default, so the tiers never test for a listener."""

    def stored(self, medium: str, keys: Sequence[CacheEngineKey]) -> None:
        return None

    def removed(self, medium: str, keys: Sequence[CacheEngineKey]) -> None:
        return None


NULL_TIER_EVENTS: TierEventSink = NullTierEventSink()
