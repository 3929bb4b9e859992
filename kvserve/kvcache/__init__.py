"""The LMCache-style KV tier: chunks of KV kept in CPU memory, on disk and in a remote store.

It knows nothing of the engine: callers hand it token ids and a KV tensor shaped
[num_layers, 2, num_tokens, num_kv_heads, head_size] and ask for them back.
"""

from __future__ import annotations

from kvserve.kvcache.cache_engine import CacheEngine, RetrieveResult
from kvserve.kvcache.config import CacheConfigError, CacheEngineConfig, load_cache_engine_config
from kvserve.kvcache.key import CacheEngineKey, CacheEngineMetadata
from kvserve.kvcache.stats import CacheStats, CacheStatsCollector

__all__ = [
    "CacheConfigError",
    "CacheEngine",
    "CacheEngineConfig",
    "CacheEngineKey",
    "CacheEngineMetadata",
    "CacheStats",
    "CacheStatsCollector",
    "RetrieveResult",
    "load_cache_engine_config",
]
