"""StorageBackend: what every tier (CPU, disk, Redis, cache server) offers the manager.

Values handed to put() are owned, contiguous CPU tensors that nobody mutates afterwards, so
a tier may keep a reference instead of a copy. Tensors returned by get() are read-only by
contract. A backend never raises on a failed or corrupt read: that is a miss.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod

import torch

from kvserve.kvcache.key import CacheEngineKey
from kvserve.kvcache.stats import CacheStats
from kvserve.kvcache.tier_events import NULL_TIER_EVENTS, TierEventSink

logger = logging.getLogger(__name__)


class StorageBackend(ABC):
    name: str = "backend"
    # The tier kind a cache controller knows it by: cpu, disk or remote.
    medium: str = "remote"
    # Told of every chunk this tier gains or drops (StorageManager.attach_events).
    events: TierEventSink = NULL_TIER_EVENTS

    def __init__(self, stats: CacheStats) -> None:
        self.stats = stats

    @abstractmethod
    def contains(self, key: CacheEngineKey) -> bool: ...

    @abstractmethod
    def get(self, key: CacheEngineKey) -> torch.Tensor | None: ...

    @abstractmethod
    def put(self, key: CacheEngineKey, kv: torch.Tensor) -> None: ...

    @abstractmethod
    def remove(self, key: CacheEngineKey) -> None: ...

    @abstractmethod
    def clear(self) -> None: ...

    def held_keys(self) -> list[CacheEngineKey] | None:
        """Every key this tier holds, or None where it cannot list them (a shared remote
        store, whose other writers it does not know of)."""
        return None

    def pin(self, key: CacheEngineKey) -> bool:
        """Keeps key from eviction until unpin(); False when the tier does not hold it."""
        return False

    def unpin(self, key: CacheEngineKey) -> None:  # noqa: B027 - optional for remote tiers
        pass

    def flush(self, timeout: float | None = None) -> None:  # noqa: B027 - sync tiers
        """Waits for writes queued off the request path."""

    def health(self) -> bool:
        return True

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        pass


class RemoteHealth:
    """Failure throttling for a remote tier: after an error, calls are skipped (misses)
    for `interval` seconds; the outage is logged once, and so is the recovery."""

    def __init__(self, name: str, interval: float) -> None:
        self.name = name
        self.interval = interval
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._retry_at = 0.0

    @property
    def is_down(self) -> bool:
        return self._down_since is not None

    def should_try(self) -> bool:
        with self._lock:
            return self._down_since is None or time.monotonic() >= self._retry_at

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            now = time.monotonic()
            self._retry_at = now + self.interval
            if self._down_since is None:
                self._down_since = now
                logger.warning(
                    "KV tier %s unavailable (%s: %s); serving misses, retrying every %.1fs",
                    self.name,
                    type(exc).__name__,
                    exc,
                    self.interval,
                )

    def succeeded(self) -> None:
        if self._down_since is None:
            return
        with self._lock:
            if self._down_since is not None:
                logger.warning(
                    "KV tier %s is back after %.1fs", self.name, time.monotonic() - self._down_since
                )
                self._down_since = None
