from __future__ import annotations

import torch

from kvserve.kvcache.key import CacheEngineKey

# [layers, 2, tokens, kv_heads, head_size]: one 16-token chunk of a small model, 24 KiB.
SHAPE = (4, 2, 16, 3, 32)
CHUNK_BYTES = 4 * 2 * 16 * 3 * 32 * 4


def key(i: int, model: str = "m") -> CacheEngineKey:
    return CacheEngineKey(model, 1, 0, f"{i:064x}", "float32")


def kv(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(SHAPE, generator=g)
