"""CacheEngineBuilder: one CacheEngine per engine instance in a process, shared by users.

A KV connector exists twice in an engine process (scheduler side and worker side); both
must see the same CPU tier, so they get the engine by instance id instead of building
their own. The last user to release it closes it.
"""

from __future__ import annotations

from typing import ClassVar

from kvserve.kvcache.cache_engine import CacheEngine
from kvserve.kvcache.config import CacheEngineConfig
from kvserve.kvcache.integrity import PLAIN, KVAuthenticator
from kvserve.kvcache.key import CacheEngineMetadata
from kvserve.kvcache.shared import SharedByKey


class CacheEngineBuilder:
    _shared: ClassVar[SharedByKey[CacheEngine]] = SharedByKey(CacheEngine.close)

    @classmethod
    def get_or_create(
        cls,
        instance_id: str,
        config: CacheEngineConfig,
        metadata: CacheEngineMetadata,
        auth: KVAuthenticator = PLAIN,
    ) -> CacheEngine:
        def same_config(engine: CacheEngine) -> None:
            if engine.config != config or engine.metadata != metadata:
                raise ValueError(f"CacheEngine {instance_id!r} exists with another config")

        return cls._shared.acquire(
            instance_id, lambda: CacheEngine(config, metadata, auth=auth), same_config
        )

    @classmethod
    def release(cls, instance_id: str) -> None:
        cls._shared.release(instance_id)

    @classmethod
    def get(cls, instance_id: str) -> CacheEngine:
        """The live engine of an instance id (KeyError if none)."""
        return cls._shared.get(instance_id)

    @classmethod
    def live(cls) -> list[CacheEngine]:
        return cls._shared.live()
