"""Pin counts shared by the bounded stores: a pinned chunk is never evicted."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class PinCounts(Generic[K]):
    """How many live lookups hold each key. Not locked: the owning store's lock guards it."""

    def __init__(self) -> None:
        self._counts: dict[K, int] = {}

    def add(self, key: K) -> None:
        self._counts[key] = self._counts.get(key, 0) + 1

    def release(self, key: K) -> None:
        count = self._counts.get(key, 0) - 1
        if count > 0:
            self._counts[key] = count
        else:
            self._counts.pop(key, None)

    def discard(self, key: K) -> None:
        self._counts.pop(key, None)

    def clear(self) -> None:
        self._counts.clear()

    def __contains__(self, key: object) -> bool:
        return key in self._counts
