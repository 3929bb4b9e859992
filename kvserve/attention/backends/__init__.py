"""Attention backends: abstract roles, shared metadata, the torch paged backend."""

from __future__ import annotations

from kvserve.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
)
from kvserve.attention.backends.registry import get_attn_backend, register_backend
from kvserve.attention.backends.utils import CommonAttentionMetadata

__all__ = [
    "AttentionBackend",
    "AttentionImpl",
    "AttentionMetadataBuilder",
    "CommonAttentionMetadata",
    "get_attn_backend",
    "register_backend",
]
