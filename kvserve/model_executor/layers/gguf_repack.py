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

Q6_K (16-weight sub-blocks, each with its own int8 scale) fits neither 32-weight plane
layout and stays float32, as do the other k-quants.
Every repacked weight still passes quantization's load-time check (dequantized blocks equal
the loaded float32 weight bit for bit).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K

__all__ = ["KIND_Q4_K_F32", "REPACKED_KINDS", "REPACKED_TYPES", "repack"]

KIND_Q4_K_F32 = 3  # csrc/block_gemm.h: Q4_1 layout, float32 d and m
_Q5_0_BYTES = 22  # f16 d, u32 high bits, 16 bytes of low nibbles
_Q4_K_BYTES = 144  # f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles

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


def _q4_k_as_q4_1_f32(raw: np.ndarray) -> Planes:
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(-1, _Q4_K_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    # gguf's own float32 products, [superblocks, 8 sub-blocks].
    scale = d * sc.astype(np.float32)
    minimum = -(dmin * mn.astype(np.float32))
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
        torch.from_numpy(np.ascontiguousarray(scale.reshape(rows, -1))),
        torch.from_numpy(np.ascontiguousarray(minimum.reshape(rows, -1))),
    )


_REPACKS = {
    GGMLQuantizationType.Q5_0: _q5_0_as_q8_0,
    GGMLQuantizationType.Q4_K: _q4_k_as_q4_1_f32,
}
REPACKED_TYPES = frozenset(_REPACKS)
# Kinds of the block types repacking produces and quantization's table lacks.
REPACKED_KINDS = {GGMLQuantizationType.Q4_K: KIND_Q4_K_F32}


def repack(raw: np.ndarray, qtype: GGMLQuantizationType) -> Planes:
    """``raw``: uint8 ``[rows, row_bytes]`` in GGUF's layout -> the kernel's planes and the
    type they now have (Q5_0 becomes Q8_0; Q4_K keeps its name, kind 3)."""
    if qtype not in _REPACKS:
        raise ValueError(f"no repacking for GGUF type {qtype.name}")
    return _REPACKS[qtype](raw)
