"""GGUF block types without a kernel of their own, repacked at load into kernel formats.

The block kernels (csrc/block_gemm.h) multiply 32-weight blocks as planes: quants ``qs``,
scale ``d`` and minimum ``m``. Two more of llama.cpp's types reduce to those exactly, so
repacking them once at load serves them without a kernel per GGUF type:

* Q5_0, ``w = d * (q - 16)`` with a 5-bit ``q``: Q8_0's ``w = d * q`` with the int8
  ``q - 16`` (-16..15), same float16 ``d``. Same float32 expression, same bits.
* Q4_K, 256-weight superblocks of 8 sub-blocks of 32 with 6-bit scale ``sc`` and minimum
  ``mn``: gguf computes ``(d * sc) * q - (dmin * mn)`` in float32, i.e. per sub-block
  Q4_1's ``D * q + M`` with ``D = d * sc`` and ``M = -(dmin * mn)`` (IEEE ``a - b`` is
  ``a + -b``, bit for bit). ``D`` and ``M`` are exact in float32 but not in float16, so
  they become kernel kind 3: Q4_1 with float32 planes.

* Q6_K, 256-weight superblocks of 16 sub-blocks of 16 with an int8 scale ``sc`` each and
  6-bit quants: gguf computes ``(d * sc) * (q - 32)`` in float32. ``q - 32`` is an int8
  (Q8_0's plane) and ``d * sc`` (11 by 8 significant bits) is exact in float32, but the
  scale changes every 16 weights: kernel kind 4, Q8_0's quants with two float32 scales
  per 32-weight block.

The digit matmul takes them with the file's own scale fields instead (AVX-512 VNNI
builds: Q4_K and Q6_K, kernel kinds 13 and 15, Q6_K's quants in 6 bits: 18.5 and 26.25
bytes per 32 weights, the file's sizes, where kinds 3 and 4 read 24 and 40; AVX2 builds:
Q4_K), and ``d * sc`` cannot be split back into ``d`` and ``sc``: so both load as their
quants beside the file's fields (BlockWeight's ``compact``; the planes below), and
BlockWeight.prepare_kernels either interleaves them as kinds 13 and 15 or expands them
(expand_scales) into kinds 3 and 4's float32 planes, the same products.

* Q4_K's fields: ``d`` float16 ``[rows, 2 superblocks]`` (each one's d, then dmin), ``m``
  uint8 ``[rows, 2 blocks]`` (each 32-weight sub-block's sc, then mn).
* Q6_K's fields: ``d`` float16 ``[rows, superblocks]``, ``m`` int8 ``[rows, 2 blocks]`` (the
  sc of each half block).

The other k-quants (Q2_K, Q3_K, Q5_K) stay float32.
Every repacked weight still passes quantization's load-time check (dequantized blocks equal
the loaded float32 weight bit for bit).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K

__all__ = [
    "COMPACT_TYPES",
    "KIND_Q4_K_F32",
    "KIND_Q6_K_F32",
    "REPACKED_KINDS",
    "REPACKED_TYPES",
    "expand_scales",
    "repack",
]

KIND_Q4_K_F32 = 3  # csrc/block_gemm.h: Q4_1 layout, float32 d and m
KIND_Q6_K_F32 = 4  # csrc/block_gemm.h: Q8_0 layout, a float32 d per 16 weights
_Q5_0_BYTES = 22  # f16 d, u32 high bits, 16 bytes of low nibbles
_Q4_K_BYTES = 144  # f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
_Q6_K_BYTES = 210  # 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, f16 d

Planes = tuple[GGMLQuantizationType, torch.Tensor, torch.Tensor, torch.Tensor]


def _q5_0_as_q8_0(raw: np.ndarray) -> Planes:
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(-1, _Q5_0_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16)[:, 0]
    high = blocks[:, 2:6].copy().view(np.uint32)  # bit i: weight i's fifth bit
    high_bits = (high >> np.arange(32, dtype=np.uint32)) & np.uint32(1)
    nibbles = blocks[:, 6:]  # byte j: weight j low, weight j + 16 high
    low = np.concatenate([nibbles & np.uint8(15), nibbles >> np.uint8(4)], axis=1)
    q = (low | (high_bits.astype(np.uint8) << np.uint8(4))).astype(np.int8) - np.int8(16)
    empty = torch.zeros(0, dtype=torch.float16)
    return (
        GGMLQuantizationType.Q8_0,
        torch.from_numpy(np.ascontiguousarray(q.reshape(rows, -1))),
        torch.from_numpy(np.ascontiguousarray(d.reshape(rows, -1))),
        empty,
    )


def _q4_k_fields(raw: np.ndarray) -> Planes:
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(-1, _Q4_K_BYTES)
    d = blocks[:, 0:4].copy().view(np.float16)  # d, dmin
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    fields = np.stack([sc.reshape(-1, 8), mn.reshape(-1, 8)], axis=-1).astype(np.uint8)
    # 4 groups of 32 bytes: sub-block 2g in the low nibbles, 2g + 1 in the high.
    packed = blocks[:, 16:].reshape(-1, 4, 1, 32)
    q = ((packed >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & np.uint8(15)).reshape(
        -1, 8, 32
    )
    # The kernel's 4-bit layout (Q4_1's): byte j holds weight j low, weight j + 16 high.
    qs = q[..., :16] | (q[..., 16:] << np.uint8(4))
    return (
        GGMLQuantizationType.Q4_K,
        torch.from_numpy(np.ascontiguousarray(qs.reshape(rows, -1))),
        torch.from_numpy(np.ascontiguousarray(d.reshape(rows, -1))),
        torch.from_numpy(np.ascontiguousarray(fields.reshape(rows, -1))),
    )


def _q6_k_fields(raw: np.ndarray) -> Planes:
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(-1, _Q6_K_BYTES)
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    sc = blocks[:, 192:208].copy().view(np.int8)
    d = blocks[:, 208:210].copy().view(np.float16)
    # gguf's unpacking: two halves of 128 weights; in each, 64 low-nibble bytes hold weights
    # j (low) and j + 64 (high), 32 bytes of 2-bit pairs weights j + 32 i for i in 0..3.
    low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low.reshape(-1, 256) | (high.reshape(-1, 256) << np.uint8(4))).astype(np.int8) - 32
    return (
        GGMLQuantizationType.Q6_K,
        torch.from_numpy(np.ascontiguousarray(q.reshape(rows, -1))),
        torch.from_numpy(np.ascontiguousarray(d.reshape(rows, -1))),
        torch.from_numpy(np.ascontiguousarray(sc.reshape(rows, -1))),
    )


def expand_scales(
    qtype: GGMLQuantizationType, d: torch.Tensor, m: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The file's fields of a Q4_K or Q6_K weight (``[rows, ...]``, as COMPACT_TYPES load
    them) -> kernel kind 3's or 4's float32 planes: gguf's own float32 products, ``d * sc``
    per sub-block and for Q4_K ``-(dmin * mn)``."""
    rows = d.shape[0]
    subs = m.reshape(rows, d.shape[1] // (2 if qtype == GGMLQuantizationType.Q4_K else 1), -1)
    if qtype == GGMLQuantizationType.Q4_K:
        supers = d.reshape(rows, -1, 1, 2).float()
        fields = subs.reshape(rows, supers.shape[1], -1, 2).float()
        scale = (supers[..., 0] * fields[..., 0]).reshape(rows, -1)
        minimum = -(supers[..., 1] * fields[..., 1])
        return scale, minimum.reshape(rows, -1)
    scale = d.reshape(rows, -1, 1).float() * subs.float()
    return scale.reshape(rows, -1), torch.zeros(0, dtype=torch.float32)


_REPACKS = {
    GGMLQuantizationType.Q5_0: _q5_0_as_q8_0,
    GGMLQuantizationType.Q4_K: _q4_k_fields,
    GGMLQuantizationType.Q6_K: _q6_k_fields,
}
REPACKED_TYPES = frozenset(_REPACKS)
# Types that load as their quants beside the file's scale fields (expand_scales).
COMPACT_TYPES = frozenset({GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K})
# Kinds of the block types repacking produces and quantization's table lacks.
REPACKED_KINDS = {
    GGMLQuantizationType.Q4_K: KIND_Q4_K_F32,
    GGMLQuantizationType.Q6_K: KIND_Q6_K_F32,
}


def repack(raw: np.ndarray, qtype: GGMLQuantizationType) -> Planes:
    """``raw``: uint8 ``[rows, row_bytes]`` in GGUF's layout -> the kernel's planes and the
    type they now have (Q5_0 becomes Q8_0; Q4_K and Q6_K keep their names, their quants
    beside the file's fields: COMPACT_TYPES)."""
    if qtype not in _REPACKS:
        raise ValueError(f"no repacking for GGUF type {qtype.name}")
    return _REPACKS[qtype](raw)
