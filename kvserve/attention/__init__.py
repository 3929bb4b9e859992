"""Attention: the model-facing ``Attention`` layer and the paged backends behind it."""

from __future__ import annotations

from kvserve.attention.backends import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    get_attn_backend,
)
from kvserve.attention.layer import (
    Attention,
    allocate_kv_caches,
    bind_kv_cache,
    get_attention_layers,
    kv_cache_bytes_per_block,
)

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionImpl",
    "AttentionMetadataBuilder",
    "CommonAttentionMetadata",
    "allocate_kv_caches",
    "bind_kv_cache",
    "get_attention_layers",
    "get_attn_backend",
    "kv_cache_bytes_per_block",
]
