"""CacheEngineBuilder: one CacheEngine per engine instance in a process, shared by users.

A KV connector exists twice in an engine process (scheduler side and worker side); both
must see the same CPU tier, so they get the engine by instance id instead of building
their own. The last user to release it closes it.
"""

from __future__ import annotations

import threading
from typing import ClassVar

from kvserve.kvcache.cache_engine import CacheEngine
from kvserve.kvcache.config import CacheEngineConfig
from kvserve.kvcache.key import CacheEngineMetadata


class CacheEngineBuilder:
    _lock: ClassVar[threading.Lock] = threading.Lock()
    _engines: ClassVar[dict[str, tuple[CacheEngine, int]]] = {}

    @classmethod
    def get_or_create(
        cls, instance_id: str, config: CacheEngineConfig, metadata: CacheEngineMetadata
    ) -> CacheEngine:
        with cls._lock:
            found = cls._engines.get(instance_id)
            if found is not None:
                engine, users = found
                if engine.config != config or engine.metadata != metadata:
                    raise ValueError(f"CacheEngine {instance_id!r} exists with another config")
                cls._engines[instance_id] = (engine, users + 1)
                return engine
            engine = CacheEngine(config, metadata)
            cls._engines[instance_id] = (engine, 1)
            return engine

    @classmethod
    def release(cls, instance_id: str) -> None:
        with cls._lock:
            found = cls._engines.get(instance_id)
            if found is None:
                return
            engine, users = found
            if users > 1:
                cls._engines[instance_id] = (engine, users - 1)
                return
            del cls._engines[instance_id]
        engine.close()
