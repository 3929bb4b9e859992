"""GGUF block weights: exact dequantization, the block matmul kernel on every path, and
the model conversion (--quantization)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from kvserve import _custom_ops as ops
from kvserve.config import ModelConfig
from kvserve.model_executor.layers.block_weight import (
    BlockWeight,
    MixedBlockWeight,
    concat_rows,
)
from kvserve.model_executor.layers.quantization import check_sampled_rows, quantize_model
from tests.gemma3_fixtures import GEMMA3
from tests.kernel_support import require_kernels

require_kernels()

TYPES = [T.Q8_0, T.Q4_1, T.Q4_0]


def _block_weight(qtype: T, rows: int, cols: int, seed: int) -> tuple[BlockWeight, torch.Tensor]:
    rng = np.random.default_rng(seed)
    raw = quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), qtype)
    reference = torch.from_numpy(dequantize(raw, qtype).astype(np.float32))
    return BlockWeight.from_raw(raw, qtype), reference


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_is_bit_exact_with_gguf(qtype: T) -> None:
    weight, reference = _block_weight(qtype, 70, 576, seed=1)
    assert weight.shape == (70, 576)
    assert torch.equal(weight.dequantize(), reference)


# Below DENSE_ROWS (64; AVX2 builds 128): the GEMV over cache-sized tiles, 6-16 rows of x
# at a time; from there: all of W dequantized, then the float32 engine's GEMM
# (dense_linear: MKL, oneDNN from 256 rows).
DENSE_ROWS = ops.block_linear_dense_rows()


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 16, 47, 63, 64, 127, 128, 130, 255, 256, 300])
@pytest.mark.parametrize("qtype", TYPES)
def test_block_linear_matches_float32_matmul(qtype: T, rows: int) -> None:
    weight, reference = _block_weight(qtype, 197, 1536, seed=rows)
    x = torch.randn(rows, 1536)
    out = weight.linear(x)
    torch.testing.assert_close(out, F.linear(x, reference), rtol=1e-4, atol=1e-4)
    if rows >= DENSE_ROWS:  # the float32 engine's very call: its result bit for bit
        assert torch.equal(out, ops.dense_linear(x, reference))
        assert torch.equal(weight.linear(x[:, None]), out[:, None])  # leading dims kept


@pytest.mark.parametrize("model", [None, GEMMA3], ids=["smollm2", "gemma3"])
def test_packaged_q8_0_heads_multiply_exactly_and_row_by_row(model: str | None) -> None:
    """The packaged files' Q8_0 embeddings, tied to their LM heads (1000 of their rows: an
    output's arithmetic does not depend on how many there are), at 1-256 rows of x: within
    float32 rounding of the float64 product of gguf's weights, and below the dense path's
    DENSE_ROWS each row's result is the same bits whatever rows share its matmul."""
    from kvserve.model_executor.model_loader.gguf_loader import iterate_gguf_blocks

    config = (
        ModelConfig(model=model, quantization="gguf") if model else ModelConfig(quantization="gguf")
    )
    assert config.resolved.path is not None
    raw = next(
        raw[:1000]
        for name, qtype, raw in iterate_gguf_blocks(config.resolved.path, config.arch)
        if name.endswith("embed_tokens.weight") and qtype == T.Q8_0
    )
    weight = BlockWeight.from_raw(raw, T.Q8_0)
    reference = weight.dequantize()
    assert torch.equal(reference, torch.from_numpy(dequantize(raw, T.Q8_0).astype(np.float32)))
    for rows in (1, 2, 3, 4, 5, 16, 17, 63, 64, 100, 127, 128, 256):
        x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))
        out = weight.linear(x)
        want = x.double() @ reference.double().T
        bound = x.abs().double() @ reference.abs().double().T
        assert ((out.double() - want).abs() <= 1e-5 * bound + 1e-30).all()
        if rows < DENSE_ROWS:
            for i in sorted({0, rows // 2, rows - 1}):
                assert torch.equal(weight.linear(x[i : i + 1])[0], out[i])


@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("qtype", TYPES)
def test_wide_rows_multiply_within_rounding_of_float64(qtype: T, rows: int) -> None:
    """Rows as wide as a 1B model's down projection (8192 weights: 256 blocks, many
    groups of 16 and prefetches far ahead of the read) against the float64 product of
    gguf's own dequantized weights, within float32 rounding of each output."""
    weight, reference = _block_weight(qtype, 130, 8192, seed=rows + 7)
    x = torch.randn(rows, 8192, generator=torch.Generator().manual_seed(rows))
    out = weight.linear(x)
    want = x.double() @ reference.double().T
    bound = x.abs().double() @ reference.abs().double().T
    assert ((out.double() - want).abs() <= 1e-5 * bound + 1e-30).all()


def test_lm_head_sized_block_linear_takes_dequantized_tiles() -> None:
    # Over 16M weights W is not dequantized whole: DENSE_ROWS+ rows go through cache-sized
    # dequantized tiles and single-threaded BLAS, below that the GEMV.
    weight, reference = _block_weight(T.Q8_0, 8200, 2048, seed=3)
    for rows in (DENSE_ROWS - 1, DENSE_ROWS + 6):
        x = torch.randn(rows, 2048)
        torch.testing.assert_close(weight.linear(x), F.linear(x, reference), rtol=1e-4, atol=1e-4)


def test_float32_linear_takes_the_dense_gemm_for_long_inputs() -> None:
    """A float32 layer multiplies long inputs as the lossless block path does once it has
    dequantized its weight (so the two agree bit for bit on prefill chunks), shorter ones
    with torch's linear; both are the float32 product."""
    from kvserve.model_executor.layers.linear import DENSE_GEMM_ROWS, ColumnParallelLinear

    layer = ColumnParallelLinear(192, 96)
    layer.weight.data.copy_(torch.randn(96, 192))
    for rows in (DENSE_GEMM_ROWS - 1, DENSE_GEMM_ROWS, 600):
        x = torch.randn(rows, 192)
        out = layer._matmul(x)
        want = ops.dense_linear(x, layer.weight) if rows >= DENSE_GEMM_ROWS else None
        assert torch.equal(out, want if want is not None else F.linear(x, layer.weight))
        exact = x.double().matmul(layer.weight.double().T).float()
        torch.testing.assert_close(out, exact, rtol=1e-4, atol=1e-4)


def test_block_linear_keeps_leading_dims_and_rejects_wrong_width() -> None:
    weight, reference = _block_weight(T.Q4_1, 64, 64, seed=3)
    x = torch.randn(2, 3, 64)
    out = weight.linear(x)
    assert out.shape == (2, 3, 64)
    torch.testing.assert_close(out, F.linear(x, reference), rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="features"):
        weight.linear(torch.randn(2, 32))


def test_concat_rows_stacks_shards_of_one_type_or_mixes_runs() -> None:
    a, ref_a = _block_weight(T.Q4_1, 8, 64, seed=4)
    b, ref_b = _block_weight(T.Q4_1, 4, 64, seed=5)
    same = concat_rows([a, b])
    assert isinstance(same, BlockWeight)
    assert torch.equal(same.dequantize(), torch.cat([ref_a, ref_b]))
    # q and k of one type beside a v of another (Llama Q4_K_M's Q4_K, Q4_K, Q6_K).
    c, ref_c = _block_weight(T.Q8_0, 4, 64, seed=6)
    mixed = concat_rows([a, b, c])
    assert isinstance(mixed, MixedBlockWeight)
    assert [(p.qtype, p.shape) for p in mixed.parts] == [(T.Q4_1, (12, 64)), (T.Q8_0, (4, 64))]
    assert mixed.shape == (16, 64) and mixed.nbytes == a.nbytes + b.nbytes + c.nbytes
    reference = torch.cat([ref_a, ref_b, ref_c])
    assert torch.equal(mixed.dequantize(), reference)
    x = torch.randn(3, 64)
    out = mixed.linear(x)
    assert torch.equal(out, torch.cat([p.linear(x) for p in mixed.parts], dim=-1))
    torch.testing.assert_close(out, F.linear(x, reference), rtol=1e-4, atol=1e-4)


def test_quantize_q8_0_round_trips_within_about_half_a_step() -> None:
    w = torch.randn(16, 128)
    q = BlockWeight.quantize(w, T.Q8_0)
    step = w.view(16, 4, 32).abs().amax(-1, keepdim=True) / 127
    # Half a quantization step, plus the float16 rounding of the block scale.
    assert ((q.dequantize() - w).view(16, 4, 32).abs() <= 0.6 * step).all()


def test_model_uses_the_files_blocks_for_every_linear_layer() -> None:
    from kvserve.model_executor.layers.linear import LinearBase
    from kvserve.model_executor.model_loader import get_model

    config = ModelConfig(quantization="gguf")
    model = get_model(config.resolved, config.arch, "cpu", torch.float32, "gguf")
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert len(linears) == 4 * config.arch.num_hidden_layers
    assert all(m.quant_weight is not None and m.weight.numel() == 0 for m in linears)
    kinds = {m.quant_weight.qtype for m in linears}  # type: ignore[union-attr]
    assert kinds == {T.Q4_1}  # SmolLM2's GGUF stores every projection as Q4_1
    head = model.lm_head.quant_weight
    assert head is not None and head.qtype == T.Q8_0  # the tied token_embd table
    # The lookups dequantize their rows from the head's blocks: no float32 table.
    embed = model.model.embed_tokens
    assert embed.row_blocks is head and embed.weight.numel() == 0
    # 4-bit weights plus scales: about a sixth of the float32 bytes.
    fp32_bytes = sum(4 * m.quant_weight.shape[0] * m.quant_weight.shape[1] for m in linears)  # type: ignore[union-attr]
    assert sum(m.quant_weight.nbytes for m in linears) < fp32_bytes / 5  # type: ignore[union-attr]


def test_quantization_config_is_validated() -> None:
    with pytest.raises(ValueError, match="quantization must be one of"):
        ModelConfig(quantization="int3")


def test_gguf_models_default_to_their_blocks_and_none_means_float32(tiny_llama: tuple) -> None:
    default = ModelConfig()
    assert (default.quantization, default.quantization_is_default) == ("gguf", True)
    explicit = ModelConfig(quantization="gguf")
    assert (explicit.quantization, explicit.quantization_is_default) == ("gguf", False)
    for spelling in ("none", "float32"):
        assert ModelConfig(quantization=spelling).quantization is None
    hf_dir = ModelConfig(model=str(tiny_llama[0]))  # HF checkpoints stay float32
    assert (hf_dir.quantization, hf_dir.quantization_is_default) == (None, False)


def _int8_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """llama.cpp's arithmetic: x quantized per 32 values to int8 (scale max|x| / 127,
    round half to even, in float32 as the kernels do it: float64 would round some
    near-halves the other way), times the exactly dequantized weight in float64."""
    rows, cols = x.shape
    blocks = x.reshape(rows, cols // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    xq = (torch.round(blocks * inverse).double() * (amax / 127).double()).reshape(rows, cols)
    return (xq @ weight.double().T).float()


# Plain layout: integer dot products for 1-3 rows, the exact float path of block_linear
# for 4+. The row-interleaved copy (AVX-512 VNNI builds) takes every row count in integer
# arithmetic. 96 columns is an odd number of blocks (the last one misses its pair in the
# plain VNNI loop); 197 rows leave a partial group of 16 in the copy; 19 rows are two full
# tiles of 8 and a partial one.
@pytest.mark.parametrize("cols", [1536, 96])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9, 19])
@pytest.mark.parametrize("qtype", TYPES)
def test_block_linear_int8_is_llamacpp_arithmetic(qtype: T, rows: int, cols: int) -> None:
    weight, reference = _block_weight(qtype, 197, cols, seed=rows)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 0.0  # an all-zero block has scale 0
    int8_reference = _int8_reference(x, reference)
    # Float32 sums in another order than the reference's: within 2e-6 of the sum of |terms|
    # (an output near zero has no relative tolerance to spare; a fixed atol failed ~1 run
    # in 50 on random inputs).
    order_tolerance = 2e-6 * (x.abs().double() @ reference.abs().double().T) + 1e-30

    def assert_same_sums(a: torch.Tensor, b: torch.Tensor) -> None:
        assert ((a.double() - b.double()).abs() <= order_tolerance).all()

    out = ops.block_linear_int8(x, weight.qs, weight.d, weight.m, weight.kind)
    if rows < 4:
        assert_same_sums(out, int8_reference)
        # The activation rounding is the only loss: well under 1% of the output's scale.
        exact = F.linear(x, reference)
        assert (out - exact).abs().max() < 0.01 * exact.abs().max()
    else:
        assert torch.equal(out, weight.linear(x))
    packed = ops.pack_blocks_vnni(weight.qs, weight.d, weight.m, weight.kind)
    if packed.numel():
        out_packed = ops.block_linear_int8(x, weight.qs, weight.d, weight.m, weight.kind, packed)
        assert_same_sums(out_packed, int8_reference)
        if rows < 4:  # the same integer dot products as the plain layout, summed in another order
            assert_same_sums(out_packed, out)
        # Integer sums are exact: a row's output does not depend on the rows beside it.
        for i in range(rows):
            alone = ops.block_linear_int8(
                x[i : i + 1], weight.qs, weight.d, weight.m, weight.kind, packed
            )
            assert torch.equal(alone[0], out_packed[i])


def test_gguf_int8_method_marks_every_block_weight() -> None:
    from kvserve.model_executor.model_loader import get_model

    config = ModelConfig(quantization="gguf_int8")
    model = get_model(config.resolved, config.arch, "cpu", torch.float32, "gguf_int8")
    weights = [m.quant_weight for m in model.modules() if getattr(m, "quant_weight", None)]
    assert weights and all(w.int8_activations for w in weights)
    assert all((w.packed is not None) == ops.packs_int8_weights() for w in weights)
    x = torch.randn(1, config.arch.hidden_size)
    head = model.lm_head.quant_weight
    assert not torch.equal(head.linear(x), F.linear(x, head.dequantize()))


def test_load_takes_the_files_blocks_without_float32_weights_and_all_are_lossless() -> None:
    """The default load (blocks attached before load_weights, sampled rows checked)
    holds the same blocks as quantize_model's whole-file check after a float32 load,
    which dequantizes every block and compares it with gguf's reference weights."""
    from kvserve.model_executor.model_loader import get_model

    config = ModelConfig(quantization="gguf")
    fast = get_model(config.resolved, config.arch, "cpu", torch.float32, "gguf")
    full = get_model(config.resolved, config.arch, "cpu", torch.float32, None)
    float_embedding = full.model.embed_tokens.weight.detach().clone()
    quantize_model(full, "gguf", config.resolved.path, config.arch)  # raises on any block
    fast_modules = dict(fast.named_modules())
    checked = 0
    for name, module in full.named_modules():
        if getattr(module, "quant_weight", None) is None:
            continue
        ours = fast_modules[name].quant_weight
        assert ours is not None and ours.qtype == module.quant_weight.qtype
        assert all(
            torch.equal(a, b) for a, b in zip(ours.planes, module.quant_weight.planes, strict=True)
        )
        checked += 1
    assert checked == 4 * config.arch.num_hidden_layers + 1  # every linear layer, the head
    # The tied table's lookups: rows of the head's blocks, gguf's float32 values bit for
    # bit, every row of the vocabulary; quantize_model drops the loaded table the same way.
    every_row = torch.arange(config.arch.vocab_size)
    for model in (fast, full):
        assert model.model.embed_tokens.weight.numel() == 0
        assert torch.equal(model.model.embed_tokens.forward(every_row), float_embedding)


# Every layout a tied LM head's blocks may have once prepared: the plain kinds, Q4_1 /
# Q4_0 in nibble planes, and the repacked Q5_0 (as Q8_0), Q4_K and Q6_K.
LOOKUP_LAYOUTS = [
    (T.Q8_0, False),
    (T.Q4_1, False),
    (T.Q4_0, False),
    (T.Q4_1, True),
    (T.Q4_0, True),
    (T.Q5_0, False),
    (T.Q4_K, False),
    (T.Q6_K, False),
]


@pytest.mark.parametrize(
    ("qtype", "planes"),
    LOOKUP_LAYOUTS,
    ids=[f"{q.name}{'-planes' if p else ''}" for q, p in LOOKUP_LAYOUTS],
)
def test_row_lookups_are_ggufs_rows_bit_for_bit(qtype: T, planes: bool) -> None:
    """An embedding tied to a GGUF head looks its rows up in the head's blocks: each row
    exactly gguf's dequantization of it, whatever the ids' shape, repeats or dtype."""
    from tests.model_executor.test_gguf_repack import _random_raw

    rows, cols = 300, 1024
    if qtype in (T.Q5_0, T.Q4_K, T.Q6_K):
        raw = _random_raw(qtype, rows, cols, seed=3)
    else:
        rng = np.random.default_rng(3)
        raw = quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), qtype)
    reference = torch.from_numpy(dequantize(raw, qtype).astype(np.float32))
    weight = BlockWeight.from_raw(raw, qtype)
    if planes:
        weight.use_nibble_planes()
        assert weight.nibble_planes
    ids = torch.tensor([[0, rows - 1, 5, 5], [17, 3, 0, rows - 1]])
    out = weight.dequantize_rows(ids)
    assert out.shape == (2, 4, cols) and torch.equal(out, reference[ids])
    assert torch.equal(weight.dequantize_rows(ids.int()), out)
    prompt = torch.randint(0, rows, (1024,), generator=torch.Generator().manual_seed(1))
    assert torch.equal(weight.dequantize_rows(prompt), reference[prompt])  # threads' split
    assert weight.dequantize_rows(torch.zeros(0, dtype=torch.long)).shape == (0, cols)
    for bad in (-1, rows):
        with pytest.raises(IndexError, match="out of range"):
            weight.dequantize_rows(torch.tensor([1, bad]))


def test_tied_gguf_head_holds_no_float32_table() -> None:
    """The model's resident tensors with the tied head on the file's blocks: the blocks
    plus small norms, not SmolLM2's 49,152 x 576 float32 table (113 MB) beside them."""
    from kvserve.model_executor.model_loader import get_model
    from kvserve.utils.huge_pages import module_tensors

    config = ModelConfig(quantization="gguf")
    model = get_model(config.resolved, config.arch, "cpu", torch.float32, "gguf")
    storages = {}
    for tensor in module_tensors(model):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
    held = sum(storages.values())
    blocks = {
        id(m.quant_weight): m.quant_weight.nbytes
        for m in model.modules()
        if getattr(m, "quant_weight", None) is not None
    }
    table = config.arch.vocab_size * config.arch.hidden_size * 4
    assert held < sum(blocks.values()) + table // 20, (held, sum(blocks.values()), table)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert params < table // 20


def test_sampled_check_catches_a_block_the_kernel_would_read_differently() -> None:
    rng = np.random.default_rng(7)
    for qtype in TYPES:
        raw = quantize((rng.standard_normal((40, 96)) * 0.05).astype(np.float32), qtype)
        good = BlockWeight.from_raw(raw, qtype)
        check_sampled_rows([("layer.weight", raw, qtype, good)])  # as stored: passes
        bad = BlockWeight.from_raw(raw, qtype)
        bad.d[-1, 2] = bad.d[-1, 2] * 2  # the last row is always among those checked
        with pytest.raises(RuntimeError, match=r"tampered\.weight"):
            check_sampled_rows(
                [("layer.weight", raw, qtype, good), ("tampered.weight", raw, qtype, bad)]
            )
