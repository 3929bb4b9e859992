"""Q4_1 / Q4_0 blocks in nibble planes (csrc/block_gemm_planes.h), the AVX2 float GEMV's
layout: dequantized bit for bit as gguf does, multiplied as the float32 weights are (on
random blocks and the packaged SmolLM2 file's tensors, 1-256 rows of x), and on a build
that prefers them (AVX2 without AVX-512) equal bit for bit to the plain layout's GEMV.
Run it with ``KVSERVE_MARCH=haswell`` too for the AVX2 build."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from kvserve import _custom_ops as ops
from kvserve.config import ModelConfig
from kvserve.model_executor.layers.block_weight import BlockWeight, concat_rows
from tests.kernel_support import require_kernels

require_kernels()

ROWS = [1, 2, 3, 5, 6, 7, 13, 16, 63, 64, 130, 256]


def _weights(
    qtype: T, rows: int, cols: int, seed: int
) -> tuple[BlockWeight, BlockWeight, torch.Tensor]:
    """(plain, nibble planes, gguf's float32 weights) of one random weight."""
    rng = np.random.default_rng(seed)
    raw = quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), qtype)
    reference = torch.from_numpy(dequantize(raw, qtype).astype(np.float32))
    planes = BlockWeight.from_raw(raw, qtype)
    planes.use_nibble_planes()
    assert planes.nibble_planes and planes.kind in (5, 6)
    return BlockWeight.from_raw(raw, qtype), planes, reference


def _check_product(
    plain: BlockWeight, planes: BlockWeight, reference: torch.Tensor, x: torch.Tensor
) -> None:
    out = planes.linear(x)
    torch.testing.assert_close(out, F.linear(x, reference), rtol=1e-4, atol=1e-4)
    if ops.gemv_prefers_nibble_planes() or x.shape[0] >= 64:
        # The plain layout's arithmetic in the same order (64+ rows: both dequantize).
        assert torch.equal(out, plain.linear(x))


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q4_0])
def test_planes_dequantize_as_gguf_and_reorder_back(qtype: T) -> None:
    plain, planes, reference = _weights(qtype, 37, 640, seed=2)
    assert not torch.equal(planes.qs, plain.qs)  # reordered, same bytes per row
    assert torch.equal(planes.dequantize(), reference)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q4_0])
def test_planes_gemv_matches_float32_and_the_plain_layout(qtype: T, rows: int) -> None:
    plain, planes, reference = _weights(qtype, 197, 1536, seed=rows)
    _check_product(plain, planes, reference, torch.randn(rows, 1536))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9])
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q4_0])
def test_planes_int8_gemv_is_the_plain_layouts_arithmetic(qtype: T, rows: int) -> None:
    """gguf_int8 on nibble planes: the same integer dot products as the plain layout
    (whose llama.cpp arithmetic test_quantization checks), summed across lanes in another
    order; 4+ rows take the exact float path."""
    plain, planes, _ = _weights(qtype, 197, 1536, seed=rows)
    x = torch.randn(rows, 1536)
    x[0, :32] = 0.0
    plain.use_int8_activations()
    planes.use_int8_activations()
    out = planes.linear(x)
    if rows < 4:
        torch.testing.assert_close(out, plain.linear(x), rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(out, ops.block_linear(x, planes.qs, planes.d, planes.m, planes.kind))


def test_rows_far_from_unit_scale_keep_their_bits() -> None:
    """x is taken scaled by 2^24 per plane; a row so large that this would overflow is
    scaled less, tiny and zero rows as usual."""
    plain, planes, reference = _weights(T.Q4_1, 70, 576, seed=5)
    x = torch.randn(6, 576)
    x[1] *= 2.0**80
    x[2] *= 2.0**-60
    x[3] = 0.0
    x[4, ::7] = 0.0
    out = planes.linear(x)
    want = F.linear(x.double(), reference.double())
    for row in range(6):
        scale = x[row].abs().max().item() * reference.abs().sum(1).max().item() + 1e-30
        assert ((out[row].double() - want[row]).abs() <= 1e-5 * scale).all()
    if ops.gemv_prefers_nibble_planes():
        assert torch.equal(out, plain.linear(x))


def test_only_q4_rows_of_whole_block_pairs_are_reordered() -> None:
    odd = BlockWeight.from_raw(quantize(np.ones((4, 96), np.float32), T.Q4_1), T.Q4_1)
    odd.use_nibble_planes()  # 3 blocks a row: stays plain
    q8 = BlockWeight.from_raw(quantize(np.ones((4, 64), np.float32), T.Q8_0), T.Q8_0)
    q8.use_nibble_planes()
    assert not odd.nibble_planes and not q8.nibble_planes
    with pytest.raises(RuntimeError, match="kinds 1-2"):
        ops.nibble_planes(q8.qs, q8.d, q8.m, 0)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        ops.dequantize_blocks(odd.qs, odd.d, odd.m, 5)
    plain, planes, _ = _weights(T.Q4_1, 8, 128, seed=1)
    with pytest.raises(ValueError, match="plain and nibble-plane"):
        concat_rows([plain, planes])
    both = concat_rows([planes, planes])
    assert isinstance(both, BlockWeight)
    assert both.nibble_planes and torch.equal(
        both.dequantize(), concat_rows([plain, plain]).dequantize()
    )


def test_packaged_smollm2_tensors() -> None:
    """One Q4 tensor of each shape in the packaged file: in nibble planes it dequantizes as
    its plain blocks and gguf do, and its GEMV matches the float32 weights at 1-256 rows.
    (The reordering depends on the shape only, so the file's other tensors of a shape add
    time, not coverage.)"""
    from kvserve.model_executor.model_loader.gguf_loader import iterate_gguf_blocks

    config = ModelConfig(quantization="gguf")
    assert config.resolved.path is not None
    shapes_done: set[tuple[int, int]] = set()
    count = 0
    for _, qtype, raw in iterate_gguf_blocks(config.resolved.path, config.arch):
        if qtype not in (T.Q4_1, T.Q4_0):
            continue
        plain = BlockWeight.from_raw(raw, qtype)
        if plain.shape in shapes_done:
            continue
        shapes_done.add(plain.shape)
        planes = BlockWeight.from_raw(raw, qtype)
        planes.use_nibble_planes()
        weights = plain.dequantize()
        assert planes.nibble_planes and torch.equal(planes.dequantize(), weights)
        count += 1
        assert torch.equal(weights, torch.from_numpy(dequantize(raw, qtype).astype(np.float32)))
        for rows in (1, 6, 7, 256):
            x = torch.randn(rows, plain.shape[1], generator=torch.Generator().manual_seed(rows))
            _check_product(plain, planes, weights, x)
    assert count > 0


@pytest.mark.parametrize("cols", [576, 1536])
def test_planes_rows_do_not_depend_on_their_batch_or_threads(cols: int) -> None:
    """Below block_linear's dense rows (128 on AVX2: prompts up to 127 tokens) every row
    of a batch is the bits of that row multiplied alone, on one thread or two."""
    _, planes, reference = _weights(T.Q4_1, 200, cols, seed=cols)
    limit = ops.block_linear_dense_rows()
    x = torch.randn(limit - 1, cols)
    alone = torch.cat([planes.linear(x[i : i + 1]) for i in range(limit - 1)])
    torch.testing.assert_close(alone, F.linear(x, reference), rtol=1e-4, atol=1e-4)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in sorted({2, 5, 6, 7, 13, 45, 63, 64, 100, limit - 1} & set(range(limit))):
                assert torch.equal(planes.linear(x[:rows]), alone[:rows])
    finally:
        torch.set_num_threads(threads)
