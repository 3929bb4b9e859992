"""Q5_0, Q4_K and Q6_K repacked into kernel formats: bit-exact with gguf's own dequantization
(random blocks and the packaged Gemma 3's tensors), the block matmul on them, and Gemma
loading with every such weight kept as blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize

from kvserve import _custom_ops as ops
from kvserve.config import ModelConfig
from kvserve.model_executor.layers.block_weight import BlockWeight
from kvserve.model_executor.layers.gguf_repack import KIND_Q4_K_F32, KIND_Q6_K_F32
from tests.kernel_support import require_kernels

require_kernels()

GEMMA3 = "gemma-3-270m"
REPACKED = [T.Q5_0, T.Q4_K, T.Q6_K]
_BLOCK = {T.Q5_0: (32, 22), T.Q4_K: (256, 144), T.Q6_K: (256, 210)}  # weights, bytes
# float16 fields of a block
_SCALE_BYTES = {T.Q5_0: [(0, 2)], T.Q4_K: [(0, 2), (2, 4)], T.Q6_K: [(208, 210)]}


def _random_raw(qtype: T, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random blocks: every quant, high-bit and 6-bit scale pattern, finite f16 scales of
    both signs (plus some zero ones)."""
    rng = np.random.default_rng(seed)
    weights, nbytes = _BLOCK[qtype]
    raw = rng.integers(0, 256, (rows, cols // weights, nbytes), dtype=np.uint8)
    for start, end in _SCALE_BYTES[qtype]:
        scale = (rng.standard_normal(raw.shape[:2]) * 0.02).astype(np.float16)
        scale[rng.random(raw.shape[:2]) < 0.05] = 0
        raw[..., start:end] = scale[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def _reference(raw: np.ndarray, qtype: T) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw, qtype).astype(np.float32))


@pytest.mark.parametrize("qtype", REPACKED)
def test_repacked_random_blocks_dequantize_bit_exact_with_gguf(qtype: T) -> None:
    raw = _random_raw(qtype, 70, 1024, seed=1)
    weight = BlockWeight.from_raw(raw, qtype)
    assert weight.shape == (70, 1024)
    assert torch.equal(weight.dequantize(), _reference(raw, qtype))
    if qtype == T.Q5_0:  # Q8_0's planes, quants -16..15
        assert weight.qtype == T.Q8_0 and weight.kind == 0
        assert int(weight.qs.min()) >= -16 and int(weight.qs.max()) <= 15
        return
    # The file's fields until prepare_kernels (gguf_repack.py), expanded where the digit
    # matmul does not take them (70 rows: not a multiple of 16)
    assert weight.compact and weight.d.dtype == torch.float16
    weight.prepare_kernels("gguf")
    assert not weight.compact and torch.equal(weight.dequantize(), _reference(raw, qtype))
    if qtype == T.Q4_K:
        assert weight.kind == KIND_Q4_K_F32 and weight.d.dtype == torch.float32
    else:  # int8 quants -32..31, a float32 scale per 16 weights
        assert weight.kind == KIND_Q6_K_F32 and weight.d.shape == (70, 1024 // 16)
        assert int(weight.qs.min()) >= -32 and int(weight.qs.max()) <= 31


def test_gemma_file_tensors_dequantize_bit_exact_with_gguf() -> None:
    reader = GGUFReader(ModelConfig(model=GEMMA3).resolved.path)
    # Q5_0 everywhere, Q4_K in o and down, Q6_K in down of half the layers
    layers = ("blk.0.", "blk.2.", "blk.17.")
    tensors = [t for t in reader.tensors if t.tensor_type in REPACKED and t.name.startswith(layers)]
    assert {t.tensor_type for t in tensors} == set(REPACKED)
    for tensor in tensors:
        raw = np.asarray(tensor.data, dtype=np.uint8)
        weight = BlockWeight.from_raw(raw, tensor.tensor_type)
        assert torch.equal(weight.dequantize(), _reference(raw, tensor.tensor_type)), tensor.name


# As in test_quantization: below block_linear_dense_rows() (64; AVX2: 128) the GEMV (6-16
# rows of x at a time), from there all of W dequantized and the float32 engine's GEMM (bit
# for bit).
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 13, 47, 64, 127, 128, 256])
@pytest.mark.parametrize("qtype", REPACKED)
def test_repacked_block_linear_matches_float32_matmul(qtype: T, rows: int) -> None:
    raw = _random_raw(qtype, 197, 1536, seed=rows)
    weight, reference = BlockWeight.from_raw(raw, qtype), _reference(raw, qtype)
    x = torch.randn(rows, 1536)
    out = weight.linear(x)
    exact = F.linear(x, reference)
    torch.testing.assert_close(out, exact, rtol=1e-4, atol=1e-4 * float(exact.abs().max()))
    if rows >= ops.block_linear_dense_rows():
        assert torch.equal(out, ops.dense_linear(x, reference))


@pytest.mark.parametrize("k_quant", [T.Q4_K, T.Q6_K])
def test_gguf_int8_keeps_k_quants_on_the_float_path_and_q5_0_on_integers(k_quant: T) -> None:
    q5 = BlockWeight.from_raw(_random_raw(T.Q5_0, 64, 256, seed=2), T.Q5_0)
    kq = BlockWeight.from_raw(_random_raw(k_quant, 64, 256, seed=3), k_quant).plain()
    x = torch.randn(1, 256)
    float_out = kq.linear(x)
    q5.use_int8_activations()
    kq.use_int8_activations()
    assert q5.int8_activations and not kq.int8_activations
    assert torch.equal(kq.linear(x), float_out)
    with pytest.raises(RuntimeError, match="kinds 0-2"):
        ops.block_linear_int8(x, kq.qs, kq.d, kq.m, kq.kind)


def test_gemma_keeps_every_linear_weight_as_blocks() -> None:
    from kvserve.model_executor.layers.linear import LinearBase
    from kvserve.model_executor.model_loader import get_model

    config = ModelConfig(model=GEMMA3, quantization="gguf")
    # Loading checks every block weight against the float32 one, bit for bit.
    model = get_model(config.resolved, config.arch, "cpu", torch.float32, "gguf")
    linears = {n: m for n, m in model.named_modules() if isinstance(m, LinearBase)}
    assert all(m.quant_weight is not None for m in linears.values())
    types: dict[str, set[T]] = {n.rpartition(".")[2]: set() for n in linears}
    for name, module in linears.items():
        if module.quant_weight is not None:
            types[name.rpartition(".")[2]].add(module.quant_weight.qtype)
    assert types == {
        "qkv_proj": {T.Q8_0},
        "o_proj": {T.Q4_K},
        "gate_up_proj": {T.Q8_0},
        "down_proj": {T.Q4_K, T.Q6_K},
    }
