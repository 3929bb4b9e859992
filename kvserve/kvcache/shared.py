"""SharedByKey: process-wide objects shared under a key and counted by their users.

The first acquire builds the object, later ones get the same object (after a check that
they asked for the same thing), and the last release closes it. Both sides of a KV
connector in one process meet this way on one CacheEngine, and on its lookup server.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class SharedByKey(Generic[T]):
    def __init__(self, close: Callable[[T], None]) -> None:
        self._close = close
        self._lock = threading.Lock()
        self._items: dict[str, tuple[T, int]] = {}

    def acquire(self, key: str, build: Callable[[], T], check: Callable[[T], None]) -> T:
        """The object under key, built if none is; ``check`` raises for an existing one
        that does not fit this user's request."""
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                item, users = found
                check(item)
                self._items[key] = (item, users + 1)
                return item
            item = build()
            self._items[key] = (item, 1)
            return item

    def release(self, key: str) -> None:
        with self._lock:
            found = self._items.get(key)
            if found is None:
                return
            item, users = found
            if users > 1:
                self._items[key] = (item, users - 1)
                return
            del self._items[key]
        self._close(item)

    def get(self, key: str) -> T:
        with self._lock:
            return self._items[key][0]

    def live(self) -> list[T]:
        with self._lock:
            return [item for item, _ in self._items.values()]
