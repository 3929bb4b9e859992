"""The paged KV cache's element codecs: float caches (float32 / float16 / bfloat16) and
the int8 cache (--kv-cache-dtype int8, and vLLM's fp8 names mapped onto it).

int8 layout: the backend's shape with the head dim widened by ``SCALE_BYTES``,
``int8 [2, num_blocks, block_size, num_kv_heads, head_size + 2]``: each (token, head) row
holds its ``head_size`` values quantized against the row's own scale, then that scale
as bfloat16 (llama.cpp's q8_0 keeps a float16 scale per 32 values; one per head row of
64-256 values costs 1-3% of the bytes, so a token takes ~1.9-2x fewer bytes than float16).

Why per row and not per (block, head): a block scale that grows when a later token is
larger changes the earlier rows' values, so what a query reads would depend on how
the prompt was chunked into steps and on which tokens shared its block; per-row scales
never change once written, so chunked prefill, prefix caching and the decode kernel all
read the same values. The scale is ``bfloat16(max|x| / 127)`` (nearest even) and a value
``round_half_even(x / scale)`` clamped to +-127: ``|x - q * scale| <= scale / 2``, and
``q * scale`` (8 significant bits times 8) is exact in float32, so dequantizing is exact
and the C++ kernel (csrc/decode_attention_int8.cpp) and the torch path read equal values.
"""

from __future__ import annotations

import torch

from kvserve import _custom_ops as ops
from kvserve.attention.backends.utils import write_to_kv_cache
from kvserve.config.model import INT8_KV_SCALE_BYTES

SCALE_BYTES = INT8_KV_SCALE_BYTES  # one bfloat16 per (token, head) row
QMAX = 127


def quantize(x: torch.Tensor) -> torch.Tensor:
    """float ``[..., D]`` -> int8 ``[..., D + SCALE_BYTES]`` (values, then the row's scale)."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = (amax / QMAX).to(torch.bfloat16)
    s = scale.float()
    # A zero scale (an all-zero row) stores zeros; x / 0 is masked, never stored.
    q = torch.where(s > 0, torch.round(x / s), torch.zeros_like(x)).clamp_(-QMAX, QMAX)
    out = torch.empty((*x.shape[:-1], x.shape[-1] + SCALE_BYTES), dtype=torch.int8, device=x.device)
    out[..., : x.shape[-1]] = q.to(torch.int8)
    out[..., x.shape[-1] :] = scale.view(torch.int8)
    return out


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 ``[..., D + SCALE_BYTES]`` -> ``dtype [..., D]``, exactly ``q * scale``."""
    rows = rows.contiguous()
    head_size = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., head_size:].view(torch.bfloat16).float()
    return (rows[..., :head_size].float() * scale).to(dtype)


class FloatKVCache:
    """float32 / float16 / bfloat16 elements: stored rounded to the cache's type."""

    @staticmethod
    def write(
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        token_indices: torch.Tensor | None,
    ) -> None:
        write_to_kv_cache(key, value, kv_cache, slot_mapping, token_indices)

    @staticmethod
    def widen(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return rows.to(dtype)

    cache_and_decode = staticmethod(ops.cache_and_decode_attention)


class Int8KVCache:
    """int8 elements with a scale per (token, head) row (the module docstring)."""

    @staticmethod
    def write(
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        token_indices: torch.Tensor | None,
    ) -> None:
        if token_indices is not None:
            key, value = key[token_indices], value[token_indices]
        num_kv_heads, row = kv_cache.shape[-2:]
        kv_cache[0].view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, quantize(key))
        kv_cache[1].view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, quantize(value))

    @staticmethod
    def widen(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(rows, dtype)

    cache_and_decode = staticmethod(ops.cache_and_decode_attention_int8)


def kv_cache_codec(kv_cache: torch.Tensor) -> type[FloatKVCache] | type[Int8KVCache]:
    """The codec of a bound cache tensor, told by its element type."""
    return Int8KVCache if kv_cache.dtype == torch.int8 else FloatKVCache


def packed_head_size(head_size: int, kv_dtype: str) -> int:
    """The cache tensor's last dim for ``head_size`` values of ``kv_dtype`` elements."""
    return head_size + SCALE_BYTES if kv_dtype == "int8" else head_size
