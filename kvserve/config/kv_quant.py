"""What an int8 KV cache (--kv-cache-dtype int8 / fp8) runs with, checked once per engine.

The int8 rows (attention/backends/kv_cache_codec.py) are read by the CPU attention
backend's torch path and its int8 decode kernel only; every other reader of the cache
tensors expects float elements, so those features decline here, naming kv_cache_dtype,
instead of reading int8 bytes as floats mid-run.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.config.engine import EngineConfig

logger = logging.getLogger(__name__)
# attention/backends/registry.py's override (a leaf module cannot import the registry).
_ENV_BACKEND = "KVSERVE_ATTENTION_BACKEND"


def configure_quantized_kv_cache(config: EngineConfig) -> None:
    """Refuse what cannot read an int8 cache; turn off cascade attention, an optional
    optimization whose shared-prefix pass reads float pages (the layers run as usual)."""
    cache = config.cache_config
    name = f"kv_cache_dtype={cache.cache_dtype!r}"
    if config.device_config.device != "cpu" or os.environ.get(_ENV_BACKEND, "CPU_ATTN") not in (
        "CPU_ATTN",
    ):
        raise ValueError(
            f"{name} runs on the CPU attention backend only; the Triton and other GPU "
            "backends read float caches (use float16 or bfloat16 there)"
        )
    if config.kv_transfer_config is not None:
        raise ValueError(
            f"{name} cannot be used with a KV connector (kv_transfer_config): the tiered "
            "cache, P/D and P2P connectors move float pages"
        )
    arch = config.model_config.arch
    if arch.mla is not None:
        raise ValueError(f"{name} is not supported for MLA models (their latent cache is float)")
    if arch.multimodal is not None and arch.multimodal.encoder_decoder:
        raise ValueError(
            f"{name} is not supported for encoder-decoder models (cross-attention K/V are float)"
        )
    if not config.model_config.disable_cascade_attn:
        logger.info("%s: cascade attention off (its shared-prefix pass reads float pages)", name)
        config.model_config.disable_cascade_attn = True
