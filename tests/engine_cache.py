"""The suite's engine cache: one LLM per distinct configuration, released with the test
module that built it (see EngineCache). A plain module, not a conftest, so that every
importer shares one registry of live caches."""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Iterator
from typing import Any, ClassVar


class EngineCache:
    """One LLM per distinct configuration (defaults filled in). An engine lives until the
    end of the test module that built it, so the suite's memory stays that of a few
    engines; a pinned one (a session fixture's) lives for the whole session."""

    live: ClassVar[list[EngineCache]] = []

    def __init__(self, **defaults: Any) -> None:
        self.defaults = defaults
        self.engines: dict[tuple[tuple[str, Any], ...], Any] = {}
        self.pinned: set[tuple[tuple[str, Any], ...]] = set()
        EngineCache.live.append(self)

    def _key(self, kwargs: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
        return tuple(sorted({**self.defaults, **kwargs}.items()))

    def __call__(self, **kwargs: Any) -> Any:
        from kvserve.entrypoints.llm import LLM

        key = self._key(kwargs)
        if key not in self.engines:
            self.engines[key] = LLM(**dict(key))
        return self.engines[key]

    def pin(self, **kwargs: Any) -> Any:
        llm = self(**kwargs)
        self.pinned.add(self._key(kwargs))
        return llm

    def release(self, *, pinned_too: bool = False) -> None:
        for key in [k for k in self.engines if pinned_too or k not in self.pinned]:
            self.engines.pop(key).llm_engine.shutdown()
        gc.collect()
        # Freed weights sit in malloc's arenas until trimmed; the next module's engine
        # should reuse that memory, not add to it.
        ctypes.CDLL("libc.so.6").malloc_trim(0)

    def close(self) -> None:
        self.release(pinned_too=True)
        EngineCache.live.remove(self)


def engine_cache(**defaults: Any) -> Iterator[EngineCache]:
    """A session fixture's engine cache; every engine in it is shut down at the end."""
    cache = EngineCache(**defaults)
    yield cache
    cache.close()
