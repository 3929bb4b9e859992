"""gguf_int8's row-interleaved copy of the blocks (csrc/block_gemm_vnni.cpp's layout, run
by AVX-512 VNNI's kernel there and by AVX2's in csrc/block_gemm_packed_avx2.cpp): llama.cpp's
arithmetic (x quantized to int8 per 32 values) within float32 rounding at 1-256 rows, the
plain layout's integer kernel where both serve (1-3 rows), and a row's result independent
of the rows beside it, on random blocks and on the packaged files' tensors. Run it with
``KVSERVE_MARCH=haswell`` too for the AVX2 build."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from kvserve import _custom_ops as ops
from kvserve.model_executor.layers.block_weight import BlockWeight
from tests.gemma3_fixtures import GEMMA3
from tests.kernel_support import require_kernels
from tests.model_executor.layers.gguf_blocks import (
    assert_rows_independent_of_threads,
    check_packaged_tensors,
    random_blocks,
)

require_kernels()
pytestmark = pytest.mark.skipif(
    not ops.packs_int8_weights(),
    reason="a build without the interleaved copy (no AVX2 or AVX-512 VNNI)",
)

TYPES = [T.Q8_0, T.Q4_1, T.Q4_0]
# 3 | 4: where the plain layout leaves integers for the float path; 4 and 8: the AVX2 and
# VNNI kernels' tiles of x rows (5, 9, 17: a partial tile after full ones).
ROWS = [1, 2, 3, 4, 5, 8, 9, 17, 64, 256]
PLAIN_INT8_ROWS = 4  # block_gemm_int8.cpp's kInt8MaxRows


def _int8_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """llama.cpp's arithmetic in float64: x rounded to int8 per block, times the weights."""
    rows, cols = x.shape
    blocks = x.reshape(rows, cols // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    xq = (torch.round(blocks * inverse).double() * (amax / 127).double()).reshape(rows, cols)
    return (xq @ weight.double().T).float()


def _packed(weight: BlockWeight) -> torch.Tensor:
    packed = ops.pack_blocks_vnni(weight.qs, weight.d, weight.m, weight.kind)
    assert packed.numel() > 0
    return packed


def _check(weight: BlockWeight, reference: torch.Tensor, x: torch.Tensor) -> None:
    packed = _packed(weight)
    out = ops.block_linear_int8(x, weight.qs, weight.d, weight.m, weight.kind, packed)
    # Within float32 rounding of the float64 reference (scaled by the sum of |terms|).
    want = _int8_reference(x, reference).double()
    bound = x.abs().double() @ reference.abs().double().T
    assert ((out.double() - want).abs() <= 2e-6 * bound + 1e-30).all()
    if x.shape[0] < PLAIN_INT8_ROWS:  # the same integer dot products, summed in another order
        plain = ops.block_linear_int8(x, weight.qs, weight.d, weight.m, weight.kind)
        assert ((out.double() - plain.double()).abs() <= 2e-6 * bound + 1e-30).all()
    # Integer sums are exact: a row's output does not depend on the rows beside it.
    for i in sorted({0, x.shape[0] // 2, x.shape[0] - 1}):
        alone = ops.block_linear_int8(
            x[i : i + 1], weight.qs, weight.d, weight.m, weight.kind, packed
        )
        assert torch.equal(alone[0], out[i])


# 197 output rows leave a partial group of 16; 96 columns an odd number of blocks.
@pytest.mark.parametrize("cols", [1536, 96])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("qtype", TYPES)
def test_packed_matmul_is_llamacpp_arithmetic(qtype: T, rows: int, cols: int) -> None:
    weight, reference = random_blocks(qtype, 197, cols, seed=rows)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 0.0  # an all-zero block has scale 0
    x[-1, 32:64] *= 1e4  # one large block beside small ones
    _check(weight, reference, x)


@pytest.mark.parametrize("qtype", TYPES)
def test_extreme_quants_do_not_saturate(qtype: T) -> None:
    """Every quant at its range's end and x at +-127 after rounding: the AVX2 kernel's
    int16 sums (a Q4 block's 8 pairs, a Q8_0 pair) stay within range."""
    cols = 256
    weight, _ = random_blocks(qtype, 16, cols, seed=0)
    top = {T.Q8_0: -128, T.Q4_1: 15, T.Q4_0: 15}[qtype]
    if qtype == T.Q8_0:
        weight.qs.fill_(top)
    else:  # both nibbles at 15
        weight.qs.fill_(0xFF)
    reference = weight.dequantize()
    x = torch.full((3, cols), 1.0)
    x[1] = -1.0
    x[2, ::2] = -1.0
    _check(weight, reference, x)


@pytest.mark.parametrize("model", [None, GEMMA3], ids=["smollm2", "gemma3"])
def test_packaged_files_tensors(model: str | None) -> None:
    """SmolLM2's Q4_1 and Gemma 3's Q8_0 and Q5_0 (taken as Q8_0) tensors."""
    check_packaged_tensors(model, (*TYPES, T.Q5_0), _check, (1, 3, 4, 64))


@pytest.mark.parametrize("qtype", TYPES)
def test_rows_are_identical_across_thread_counts(qtype: T) -> None:
    """Threads split the weight's groups of 16 outputs, each summed whole on one thread in
    one order (with or without the records requested ahead at 1-3 rows): a row's outputs
    are the same bits on 1 and 2 threads, alone and in every tile of x rows."""
    weight, _ = random_blocks(qtype, 16 * 37 + 5, 640, seed=7)
    packed = _packed(weight)
    x = torch.randn(9, 640, generator=torch.Generator().manual_seed(9))
    assert_rows_independent_of_threads(  # each tile width the kernel has, from the same rows
        lambda rows: ops.block_linear_int8(
            rows, weight.qs, weight.d, weight.m, weight.kind, packed
        ),
        x,
        (1, 2, 3, 4),
    )
