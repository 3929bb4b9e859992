"""Engine configuration: flat dataclasses, each validated in __post_init__.

One module per part (the model, how the engine runs, KV transfer, optional features,
multimodal inputs) and EngineConfig, which checks them against each other; everything is
importable from ``kvserve.config``.
"""

from kvserve.config.engine import EngineConfig
from kvserve.config.features import (
    SPECULATIVE_METHODS,
    LoRAConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from kvserve.config.json_args import dataclass_from_json
from kvserve.config.kv_transfer import KVEventsConfig, KVSecurityConfig, KVTransferConfig
from kvserve.config.model import (
    DEFAULT_MODEL,
    KV_CACHE_DTYPES,
    MODEL_DTYPES,
    NO_QUANTIZATION,
    QUANTIZATION_METHODS,
    GiB,
    ModelConfig,
    resolve_dtype,
)
from kvserve.config.multimodal import ECTransferConfig, MultiModalConfig
from kvserve.config.runtime import CacheConfig, DeviceConfig, ParallelConfig, SchedulerConfig

__all__ = [
    "DEFAULT_MODEL",
    "KV_CACHE_DTYPES",
    "MODEL_DTYPES",
    "NO_QUANTIZATION",
    "QUANTIZATION_METHODS",
    "SPECULATIVE_METHODS",
    "CacheConfig",
    "DeviceConfig",
    "ECTransferConfig",
    "EngineConfig",
    "GiB",
    "KVEventsConfig",
    "KVSecurityConfig",
    "KVTransferConfig",
    "LoRAConfig",
    "ModelConfig",
    "MultiModalConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "StructuredOutputsConfig",
    "dataclass_from_json",
    "resolve_dtype",
]
