"""A linear weight kept as llama.cpp's 32-weight blocks (BlockWeight): its planes as the
C++ kernels read them (csrc/block_quants.h), the layouts it can be reordered into for this
build's kernels, and its matmul. quantization.py decides which weights of a model become
blocks and attaches them.

* On AVX-512 VNNI builds the lossless method's planes (every kind: Q8_0, Q4_1, Q4_0, Q4_K
  and Q6_K; on AVX2 builds the 4-bit ones, Q4_1, Q4_0 and Q4_K, whose int16 sums cannot
  saturate) are interleaved 16 rows at a time for the digit matmul
  (csrc/block_gemm_exact.cpp: x split exactly into int8 digits, integer dot products): the
  same bytes reordered, no copy kept; Q5_0's repacked Q8_0 blocks go back to 5 bits a
  quant there (a third less to read than the Q8_0 planes), and Q4_K and Q6_K keep the
  file's scale fields (kinds 13 and 15: 18.5 and 26.25 bytes per 32 weights, the file's
  own sizes, where the float32 scales of kinds 10-11 take 24 and 40), Q6_K's quants in 6
  bits. Elsewhere those two expand into float32 scales (kinds 3-4, gguf_repack.py).
* On builds whose float GEMV is AVX2 without AVX-512, Q4_1 and Q4_0 quants the digit
  matmul does not take (rows not a multiple of 16, the screened head) are reordered into
  nibble planes (csrc/block_gemm_planes.h): fewer instructions per weight, the same
  float32 results bit for bit.
* gguf_int8 keeps the plain planes and, with AVX-512 VNNI or AVX2, a row-interleaved copy
  for its int8 matmuls (csrc/block_gemm_vnni.cpp).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from kvserve import _custom_ops as ops
from kvserve.model_executor.layers.gguf_repack import (
    COMPACT_TYPES,
    REPACKED_KINDS,
    REPACKED_TYPES,
    expand_scales,
    repack,
)

# GGML type -> (kernel kind, bytes per 32-weight block, has a per-block minimum)
_KINDS: dict[GGMLQuantizationType, tuple[int, int, bool]] = {
    GGMLQuantizationType.Q8_0: (0, 34, False),
    GGMLQuantizationType.Q4_1: (1, 20, True),
    GGMLQuantizationType.Q4_0: (2, 18, False),
}
# Kernel kinds of Q4_1 and Q4_0 in nibble planes (csrc/block_quants.h).
_NIBBLE_PLANE_KINDS = {GGMLQuantizationType.Q4_1: 5, GGMLQuantizationType.Q4_0: 6}
# Kernel kinds of Q8_0, Q4_1, Q4_0 and the repacked Q4_K and Q6_K interleaved 16 rows at a
# time.
_INTERLEAVED_KINDS = {
    GGMLQuantizationType.Q8_0: 7,
    GGMLQuantizationType.Q4_1: 8,
    GGMLQuantizationType.Q4_0: 9,
    GGMLQuantizationType.Q4_K: 10,
    GGMLQuantizationType.Q6_K: 11,
}
# Kernel kinds of interleaved Q4_K and Q6_K with the file's scale fields (Q6_K's quants
# one a byte: use_interleaved goes on to kind 15).
_COMPACT_KINDS = {GGMLQuantizationType.Q4_K: 13, GGMLQuantizationType.Q6_K: 14}
# Kind 14 in 6 bits (csrc/block_quants.h): its kind and bytes per row and block (16 of
# nibbles, 8 of bits 4 and 5).
_SIX_BIT_KIND, _SIX_BIT_BLOCK_BYTES = 15, 24
# Interleaved Q8_0 in 5 bits (csrc/block_quants.h): its kind and bytes per row and block
# (16 of nibbles, 4 of fifth bits).
_FIVE_BIT_KIND, _FIVE_BIT_BLOCK_BYTES = 12, 20
# Types whose quants are bytes (the 4-bit ones pack two a byte).
_BYTE_QUANT_TYPES = frozenset({GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q6_K})
_INTERLEAVED_ROWS = 16
# Q5_0, Q4_K and Q6_K are repacked at load into kernel formats (gguf_repack.py).
SUPPORTED_TYPES = frozenset(_KINDS) | REPACKED_TYPES


@dataclass
class BlockWeight:
    """A ``[rows, cols]`` weight as separate planes of its blocks (see csrc/block_gemm.h)."""

    qtype: GGMLQuantizationType
    qs: torch.Tensor  # int8 [rows, cols] (Q8_0, Q6_K) or uint8 [rows, cols/2] (4-bit)
    # float16 [rows, cols/32], as stored; float32 for repacked Q4_K, [rows, cols/16] Q6_K
    # (compact: the file's fields, gguf_repack.py)
    d: torch.Tensor
    m: torch.Tensor  # like d for Q4_1 and Q4_K, else empty (compact: the sub-block fields)
    int8_activations: bool = False
    # gguf_int8 on AVX-512 VNNI or AVX2: the same blocks interleaved 16 rows at a time
    # for its matmuls (csrc/block_gemm_vnni.cpp); None elsewhere.
    packed: torch.Tensor | None = None
    # qs reordered into nibble planes for the AVX2 float GEMV (use_nibble_planes).
    nibble_planes: bool = False
    # qs, d and m interleaved 16 rows at a time for the lossless digit matmul (AVX-512
    # VNNI, or AVX2's 4-bit kinds: use_interleaved).
    interleaved: bool = False
    # Interleaved Q8_0 whose quants all lie in -16..15 (GGUF's Q5_0, repacked), in 5 bits.
    five_bit: bool = False
    # Q4_K and Q6_K with the file's scale fields in d and m (gguf_repack.py): interleaved,
    # kinds 13 and 15; plain, a load-time form that prepare_kernels lays out for a kernel.
    compact: bool = False
    # Interleaved compact Q6_K with its quants in 6 bits (kind 15).
    six_bit: bool = False

    @property
    def kind(self) -> int:
        if self.nibble_planes:
            return _NIBBLE_PLANE_KINDS[self.qtype]
        if self.interleaved:
            if self.compact:
                return _SIX_BIT_KIND if self.six_bit else _COMPACT_KINDS[self.qtype]
            return _FIVE_BIT_KIND if self.five_bit else _INTERLEAVED_KINDS[self.qtype]
        if self.compact:
            raise ValueError(
                f"{self.qtype.name}'s file fields have no kernel: prepare_kernels first"
            )
        return _KINDS[self.qtype][0] if self.qtype in _KINDS else REPACKED_KINDS[self.qtype]

    @property
    def shape(self) -> tuple[int, int]:
        rows, qs_cols = self.qs.shape
        if self.five_bit:
            return rows, qs_cols // _FIVE_BIT_BLOCK_BYTES * 32
        if self.six_bit:
            return rows, qs_cols // _SIX_BIT_BLOCK_BYTES * 32
        return rows, qs_cols * (1 if self.qs.dtype == torch.int8 else 2)

    @property
    def planes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.qs, self.d, self.m

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m))

    def use_int8_activations(self) -> None:
        """Switch to gguf_int8's arithmetic, with the interleaved copy where the CPU has
        AVX-512 VNNI or AVX2. Repacked Q4_K and Q6_K (float32 scales) have no integer
        kernel and keep the exact float path."""
        if self.qtype in REPACKED_KINDS:
            return
        if self.interleaved:  # gguf_int8's kernels read the plain layout (and their copy)
            self.qs, self.d, self.m = self.plain().planes
            self.interleaved = self.five_bit = False
        self.int8_activations = True
        if self.nibble_planes:  # the interleaved copy is made from the plain layout
            return
        packed = ops.pack_blocks_vnni(self.qs, self.d, self.m, self.kind)
        self.packed = packed if packed.numel() else None

    def use_interleaved(self) -> None:
        """Interleave the planes 16 rows at a time for the lossless digit matmul where the
        build has it for the weight's kind (ops.exact_packed_kinds: x split exactly into
        int8 digits, integer dot products, csrc/block_gemm_exact.cpp). AVX-512 VNNI: every
        kind, one row of x 1.7-2.2x the float GEMV's speed on AMD EPYC Zen 4, and faster
        at every decode batch size. AVX2: the 4-bit kinds, one row of x 1.26-1.85x the
        float GEMV's speed in cache (AMD EPYC Zen 5 running the haswell build; from DRAM
        Q4_1 0.91-1.31x, Q4_0 1.5x); several rows take a float32 path on the same blocks,
        0.82-1.25x the float GEMV on nibble planes (tools/bench_digit_matmul.py). The
        same bytes, reordered: no copy is kept. Weights of a multiple of 16 rows only."""
        if self.interleaved or self.int8_activations or self.nibble_planes:
            return
        if self.qtype not in _INTERLEAVED_KINDS or self.shape[0] % _INTERLEAVED_ROWS:
            return
        five_bit = self.qtype == GGMLQuantizationType.Q8_0 and _fits_five_bits(self.qs)
        if five_bit:
            kind = _FIVE_BIT_KIND
        elif self.compact:
            kind = _COMPACT_KINDS[self.qtype]
        else:
            kind = _INTERLEAVED_KINDS[self.qtype]
        if kind not in ops.exact_packed_kinds():
            return
        if five_bit:
            self.qs, self.d = _interleave_five_bit(self.qs, self.d, inverse=False)
            self.five_bit = True
        else:
            self.qs, self.d, self.m = _interleave(
                self.qtype, self.qs, self.d, self.m, inverse=False, compact=self.compact
            )
            # Every Q6_K quant fits 6 bits: the file's size, where kind 14 reads 34.25 bytes
            # per 32 weights.
            if self.compact and self.qtype == GGMLQuantizationType.Q6_K:
                self.qs = _interleave_six_bit(self.qs, inverse=False)
                self.six_bit = True
        self.interleaved = True

    def use_float32_scales(self) -> None:
        """Expand the file's Q4_K / Q6_K fields into kinds 3 and 4's float32 scales (the
        same products), for the kernels other than the digit matmul. Plain layout only."""
        if not self.compact:
            return
        if self.interleaved:
            raise ValueError("float32 scales of an interleaved weight: take its plain()")
        self.d, self.m = expand_scales(self.qtype, self.d, self.m)
        self.compact = False

    def plain(self) -> BlockWeight:
        """This weight in a plain layout its kernels read (itself if it is in one): the
        file's Q4_K / Q6_K fields become kinds 3 and 4's float32 scales."""
        if not self.interleaved and not self.compact:
            return self
        if self.five_bit:
            qs, d = _interleave_five_bit(self.qs, self.d, inverse=True)
            return BlockWeight(self.qtype, qs, d, self.m)
        qs, d, m = self.planes
        if self.six_bit:
            qs = _interleave_six_bit(qs, inverse=True)
        if self.interleaved:
            qs, d, m = _interleave(self.qtype, qs, d, m, inverse=True, compact=self.compact)
        plain = BlockWeight(self.qtype, qs, d, m, compact=self.compact)
        plain.use_float32_scales()
        return plain

    def use_nibble_planes(self) -> None:
        """Reorder Q4_1 / Q4_0 quants into nibble planes (rows of a multiple of 64 weights;
        others stay as they are). Not after gguf_int8's interleaved copy, made from the
        plain layout."""
        if self.nibble_planes or self.qtype not in _NIBBLE_PLANE_KINDS or self.shape[1] % 64:
            return
        if self.interleaved:
            raise ValueError("nibble planes after interleaving")
        if self.packed is not None:
            raise ValueError("nibble planes after gguf_int8's interleaved copy")
        self.qs = ops.nibble_planes(self.qs, self.d, self.m, self.kind)
        self.nibble_planes = True

    def prepare_kernels(self, method: str, interleave: bool = True) -> None:
        """Give the weight the arithmetic and layout its method and this build's kernels
        run best: gguf_int8's int8 activations, or (``interleave``) the lossless digit
        matmul's interleaved planes where the build has it; then nibble planes where the
        float GEMV prefers them (ops.gemv_prefers_nibble_planes)."""
        if method == "gguf_int8" and self.qtype not in REPACKED_KINDS:
            self.use_int8_activations()
        elif interleave:  # gguf_int8's repacked Q4_K and Q6_K too: they have no int8 kernel
            self.use_interleaved()
        # Only the digit matmul reads the file's k-quant fields (kinds 13-15).
        if self.compact and not self.interleaved:
            self.use_float32_scales()
        # gguf_int8's interleaved copy and the digit matmul serve every input the float
        # GEMV would.
        if ops.gemv_prefers_nibble_planes() and self.packed is None and not self.interleaved:
            self.use_nibble_planes()

    @classmethod
    def from_raw(cls, raw: np.ndarray, qtype: GGMLQuantizationType) -> BlockWeight:
        """``raw``: uint8 ``[rows, row_bytes]`` in GGUF's block layout (f16 d, [f16 m], quants)."""
        if qtype in REPACKED_TYPES:
            ops.require()
            return cls(*repack(raw, qtype), compact=qtype in COMPACT_TYPES)
        if qtype not in _KINDS:
            raise ValueError(f"no kernel for GGUF type {qtype.name}")
        ops.require()
        _, block_bytes, has_min = _KINDS[qtype]
        rows = raw.shape[0]
        # One record per block: taking a field copies whole quant runs, not single bytes
        # (2x faster, and the load's largest copy).
        head = [("d", "<f2")] + ([("m", "<f2")] if has_min else [])
        quant_bytes = block_bytes - 2 * len(head)
        blocks = np.ascontiguousarray(raw).view(np.dtype([*head, ("q", f"V{quant_bytes}")]))
        d = np.ascontiguousarray(blocks["d"])
        m = np.ascontiguousarray(blocks["m"]) if has_min else np.zeros((0,), np.float16)
        quants = np.ascontiguousarray(blocks["q"]).view(np.uint8).reshape(rows, -1)
        if qtype == GGMLQuantizationType.Q8_0:
            quants = quants.view(np.int8)
        return cls(qtype, torch.from_numpy(quants), torch.from_numpy(d), torch.from_numpy(m))

    @classmethod
    def quantize(cls, weight: torch.Tensor, qtype: GGMLQuantizationType) -> BlockWeight:
        """Quantize a float32 ``[rows, cols]`` weight with the gguf package's quantizer."""
        if weight.shape[-1] % 32:
            raise ValueError(f"cannot quantize {tuple(weight.shape)}: columns not a multiple of 32")
        raw = gguf_quantize(weight.detach().float().cpu().numpy(), qtype)
        return cls.from_raw(raw, qtype)

    def _kernel_form(self) -> BlockWeight:
        """Itself, or before prepare_kernels the file's k-quant fields as kinds 3 and 4 (a
        copy: load checks and tests read weights whose kernels are not chosen yet)."""
        return self.plain() if self.compact and not self.interleaved else self

    def dequantize(self) -> torch.Tensor:
        w = self._kernel_form()
        return ops.dequantize_blocks(w.qs, w.d, w.m, w.kind)

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` as float32 ``[*ids.shape, cols]``, each the row of dequantize()."""
        w = self._kernel_form()
        return ops.dequantize_rows(w.qs, w.d, w.m, w.kind, ids)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_activations:
            return ops.block_linear_int8(x, self.qs, self.d, self.m, self.kind, self.packed)
        w = self._kernel_form()
        return ops.block_linear(x, w.qs, w.d, w.m, w.kind)


def _interleave(
    qtype: GGMLQuantizationType,
    qs: torch.Tensor,
    d: torch.Tensor,
    m: torch.Tensor,
    inverse: bool,
    compact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain planes as the interleaved kinds hold them (csrc/block_quants.h: per group of
    16 rows and block, the rows' 4-byte chunks in chunk order, byte quants as q + 128,
    the scales of the group's rows side by side, Q6_K's low-half then high-half ones; the
    file's k-quant fields (``compact``) likewise per super-block and per block), or back
    (``inverse``)."""
    rows, row_bytes = qs.shape
    byte_quants = qtype in _BYTE_QUANT_TYPES
    groups, nb = rows // _INTERLEAVED_ROWS, row_bytes // (32 if byte_quants else 16)
    chunks = row_bytes // nb // 4
    plain_order = (groups, _INTERLEAVED_ROWS, nb, chunks, 4)
    interleaved_order = (groups, nb, chunks, _INTERLEAVED_ROWS, 4)
    quants = qs.view(torch.uint8)
    if byte_quants:
        quants = quants ^ 0x80  # q + 128 in two's complement, and back
    if inverse:
        quants = quants.reshape(interleaved_order).permute(0, 3, 1, 2, 4)
    else:
        quants = quants.reshape(plain_order).permute(0, 2, 3, 1, 4)
    quants = quants.contiguous().view(qs.dtype).reshape(rows, row_bytes)

    def scales(plane: torch.Tensor, units: int) -> torch.Tensor:
        """``units``: a row's runs of fields (blocks, or super-blocks), each kept whole."""
        if not plane.numel():
            return plane
        per_unit = plane.numel() // (rows * units)
        if inverse:
            shape, order = (groups, units, per_unit, _INTERLEAVED_ROWS), (0, 3, 1, 2)
        else:
            shape, order = (groups, _INTERLEAVED_ROWS, units, per_unit), (0, 2, 3, 1)
        return plane.reshape(shape).permute(order).contiguous().reshape(plane.shape)

    return quants, scales(d, nb // 8 if compact else nb), scales(m, nb)


def _fits_five_bits(qs: torch.Tensor) -> bool:
    return bool(qs.numel()) and int(qs.min()) >= -16 and int(qs.max()) <= 15


def _interleave_five_bit(
    qs: torch.Tensor, d: torch.Tensor, inverse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 planes whose quants lie in -16..15 as kind 12 holds them (csrc/block_quants.h:
    per group of 16 rows and block, kind 9's interleaved nibbles of q + 16, then per chunk
    the two 64-bit masks of their fifth bits), or back (``inverse``)."""
    rows, g = qs.shape[0], _INTERLEAVED_ROWS
    groups = rows // g
    nb = qs.shape[1] // (_FIVE_BIT_BLOCK_BYTES if inverse else 32)
    bit_weights = 1 << torch.arange(8, dtype=torch.uint8)
    if inverse:
        record = qs.reshape(groups, nb, g * _FIVE_BIT_BLOCK_BYTES)
        # nibble bytes [groups, nb, chunk, row, byte] -> [groups, row, nb, chunk, byte]
        nibbles = record[..., : g * 16].reshape(groups, nb, 4, g, 4).permute(0, 3, 1, 2, 4)
        nibbles = nibbles.reshape(rows, nb, 16)
        low = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)
        bits = (record[..., g * 16 :].reshape(groups, nb, 4, 2, 8, 1) & bit_weights) != 0
        # bits [groups, nb, chunk, half, row, byte] -> [groups, row, nb, half, chunk, byte]
        bits = bits.reshape(groups, nb, 4, 2, g, 4).permute(0, 4, 1, 3, 2, 5).reshape(rows, nb, 32)
        quants = (low.to(torch.int16) + 16 * bits.to(torch.int16) - 16).to(torch.int8)
        scales = d.reshape(groups, nb, g).transpose(1, 2).contiguous().reshape(d.shape)
        return quants.reshape(rows, nb * 32), scales
    unsigned = (qs.reshape(rows, nb, 32).to(torch.int16) + 16).to(torch.uint8)
    low = unsigned & 15
    nibbles = (low[..., :16] | (low[..., 16:] << 4)).reshape(groups, g, nb, 4, 4)
    nibbles = nibbles.permute(0, 2, 3, 1, 4).reshape(groups, nb, g * 16)
    bits = (unsigned >> 4).reshape(groups, g, nb, 2, 4, 4).permute(0, 2, 4, 3, 1, 5)
    masks = (bits.reshape(groups, nb, 4, 2, 8, 8) * bit_weights).sum(-1, dtype=torch.uint8)
    record = torch.cat([nibbles, masks.reshape(groups, nb, 64)], dim=-1)
    scales = d.reshape(groups, g, nb).transpose(1, 2).contiguous().reshape(d.shape)
    return record.reshape(rows, nb * _FIVE_BIT_BLOCK_BYTES), scales


def _interleave_six_bit(qs: torch.Tensor, inverse: bool) -> torch.Tensor:
    """Kind 14's interleaved Q6_K quants as kind 15 holds them (csrc/block_quants.h: per
    group of 16 rows and block, kind 9's nibbles of the file's u = q + 32, the low nibbles
    from chunks 0-3, the high from 4-7, then per chunk the 64-bit masks of bits 4 and 5 of
    the low nibbles' quants and of the high ones'), or back (``inverse``)."""
    rows, g = qs.shape[0], _INTERLEAVED_ROWS
    groups = rows // g
    bit_weights = 1 << torch.arange(8, dtype=torch.uint8)
    if inverse:
        nb = qs.shape[1] // _SIX_BIT_BLOCK_BYTES
        record = qs.reshape(groups, nb, g * _SIX_BIT_BLOCK_BYTES)
        nibbles = record[..., : g * 16].reshape(groups, nb, 4, g * 4)
        low = torch.stack([nibbles & 15, nibbles >> 4], dim=2)  # [groups, nb, half, chunk, 64]
        bits = (record[..., g * 16 :].reshape(groups, nb, 4, 2, 2, 8, 1) & bit_weights) != 0
        # bits [groups, nb, chunk, half, bit, 64] -> [groups, nb, half, chunk, bit, 64]
        bits = bits.reshape(groups, nb, 4, 2, 2, g * 4).permute(0, 1, 3, 2, 4, 5).to(torch.uint8)
        unsigned = low + 16 * bits[..., 0, :] + 32 * bits[..., 1, :]
        return (unsigned + 96).reshape(rows, nb * 32).view(torch.int8)  # q + 128
    nb = qs.shape[1] // 32
    # kind 14's chunks 4 half + c: [groups, nb, half, chunk, 64], q + 128 - 96 = u
    unsigned = qs.view(torch.uint8).reshape(groups, nb, 2, 4, g * 4) - 96
    nibbles = (unsigned[:, :, 0] & 15) | ((unsigned[:, :, 1] & 15) << 4)
    bits = torch.stack([(unsigned >> 4) & 1, unsigned >> 5], dim=3)
    # bits [groups, nb, half, bit, chunk, 64] -> [groups, nb, chunk, half, bit, 64]
    bits = bits.permute(0, 1, 4, 2, 3, 5).reshape(groups, nb, 4, 2, 2, 8, 8)
    masks = (bits * bit_weights).sum(-1, dtype=torch.uint8)
    record = torch.cat([nibbles.reshape(groups, nb, g * 16), masks.reshape(groups, nb, 128)], -1)
    return record.reshape(rows, nb * _SIX_BIT_BLOCK_BYTES)


@dataclass
class MixedBlockWeight:
    """A fused layer's weight whose shards differ in block type once repacked (Llama
    Q4_K_M files' Q4_K q and k beside a Q6_K v, in a third of the layers): a BlockWeight
    per run of same-type shards, each multiplied into its own output features."""

    parts: list[BlockWeight]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def prepare_kernels(self, method: str, interleave: bool = True) -> None:
        for part in self.parts:
            part.prepare_kernels(method, interleave)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.linear(x) for p in self.parts], dim=-1)


# A linear layer's block weights.
LinearBlocks = BlockWeight | MixedBlockWeight


def concat_rows(parts: list[BlockWeight]) -> LinearBlocks:
    """Stack shards (q/k/v, gate/up) along the output rows, as the fused layers do: one
    BlockWeight where they share a block type, else a MixedBlockWeight of the runs that do."""
    if len({p.nibble_planes for p in parts}) != 1:
        raise ValueError("fused shards mix plain and nibble-plane layouts")
    if any(p.interleaved for p in parts):
        raise ValueError("interleaved shards: stack the plain ones, then interleave")
    runs: list[list[BlockWeight]] = []
    for part in parts:
        if runs and (runs[-1][0].qtype, runs[-1][0].compact) == (part.qtype, part.compact):
            runs[-1].append(part)
        else:
            runs.append([part])
    stacked = [
        BlockWeight(
            run[0].qtype,
            torch.cat([p.qs for p in run]),
            torch.cat([p.d for p in run]),
            torch.cat([p.m for p in run]),
            run[0].int8_activations,
            nibble_planes=run[0].nibble_planes,
            compact=run[0].compact,
        )
        for run in runs
    ]
    return stacked[0] if len(stacked) == 1 else MixedBlockWeight(stacked)
