"""The lossless digit matmul on blocks interleaved 16 rows at a time (kinds 7-15,
csrc/block_gemm_exact.cpp, AVX-512 VNNI builds): x split exactly into int8 digits, the
GGUF weights exactly. Its results are the float32 product of gguf's own dequantized
weights within float32 rounding at 1-256 rows (the float GEMV's tolerance), on random
blocks of every kind it takes, on outlier, tiny, zero and non-finite inputs and on the
packaged files' tensors; the interleaved planes dequantize bit for bit as the plain ones;
a row's result never depends on the rows beside it or the thread count; the lossless
method uses it by default where the build has it. Q4_K and Q6_K with the file's scale
fields (kinds 13-14) give kinds 10-11's results bit for bit from fewer bytes, and Q6_K's
quants in 6 bits (kind 15) kind 14's from the file's own size."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType as T

from kvserve import _custom_ops as ops
from kvserve.model_executor.layers.block_weight import (
    BlockWeight,
    _interleave,
    _interleave_six_bit,
    concat_rows,
)
from kvserve.model_executor.layers.quantization import _rank_blocks
from tests.gemma3_fixtures import GEMMA3
from tests.kernel_support import require_kernels
from tests.model_executor.layers.gguf_blocks import (
    K_QUANTS,
    assert_rows_independent_of_threads,
    check_packaged_tensors,
    random_blocks,
    random_raw,
)

require_kernels()
pytestmark = pytest.mark.skipif(
    not ops.exact_packed_matmul(),
    reason="a build without AVX-512 VNNI (the digit matmul's kernel)",
)

# Q5_0, Q4_K and Q6_K as loaded (Q5_0: Q8_0 planes, interleaved in 5 bits; Q4_K and Q6_K
# with the file's scale fields, kinds 13 and 15).
TYPES = [T.Q8_0, T.Q4_1, T.Q4_0, T.Q5_0, T.Q4_K, T.Q6_K]
# 4: the kernel's tile of x rows (5, 9, 17: partial tiles after full ones); it serves up
# to 255 rows, 256 take block_linear's dense path on the interleaved planes' dequantized rows.
ROWS = [1, 2, 3, 4, 5, 9, 17, 64, 255, 256]


def _interleaved(weight: BlockWeight) -> BlockWeight:
    """A copy of a plain weight, interleaved."""
    copy = BlockWeight(
        weight.qtype, weight.qs.clone(), weight.d.clone(), weight.m.clone(), compact=weight.compact
    )
    copy.use_interleaved()
    assert copy.interleaved and copy.kind in (7, 8, 9, 12, 13, 15)
    return copy


def _exact(weight: BlockWeight, x: torch.Tensor) -> torch.Tensor:
    assert weight.interleaved
    return weight.linear(x)


def _bound(plain: BlockWeight, x: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Float32 rounding of the sums (2e-6 of the sum of |terms|, as the float GEMV is held
    to; a block's terms are d q x and m x, |d q| <= |w| + |m|) plus the digits' own
    rounding: each value at 2^-31 of its block's largest |x|, which reaches the result
    through the block's d q."""
    rows, cols = x.shape
    plain = plain.plain()  # the k-quants' float32 minimums
    magnitude = reference.abs().double()
    if plain.m.numel():
        magnitude += plain.m.double().abs().reshape(magnitude.shape[0], -1).repeat_interleave(32, 1)
    block_max = x.abs().double().reshape(rows, cols // 32, 32).amax(-1)
    block_l1 = magnitude.reshape(magnitude.shape[0], cols // 32, 32).sum(-1)
    terms = x.abs().double() @ magnitude.T
    return 2e-6 * terms + 2.0**-31 * (block_max @ block_l1.T) + 1e-30


def _check(plain: BlockWeight, reference: torch.Tensor, x: torch.Tensor) -> None:
    weight = _interleaved(plain)
    assert torch.equal(weight.dequantize(), plain.dequantize())
    out = _exact(weight, x)
    want = x.double() @ reference.double().T
    bound = _bound(plain, x, reference)
    assert ((out.double() - want).abs() <= bound).all()
    if x.shape[0] < ops.block_linear_dense_rows():  # the integer sums are exact
        for i in sorted({0, x.shape[0] // 2, x.shape[0] - 1}):
            assert torch.equal(_exact(weight, x[i : i + 1])[0], out[i])


# 208 output rows: 13 groups of 16; 96 columns an odd number of blocks (the k-quants:
# 768, an odd number of their 256-weight super-blocks).
@pytest.mark.parametrize(
    ("qtype", "cols"),
    [(qtype, cols) for qtype in TYPES for cols in (1536, 768 if qtype in K_QUANTS else 96)],
)
@pytest.mark.parametrize("rows", ROWS)
def test_exact_matmul_is_the_float32_product(qtype: T, rows: int, cols: int) -> None:
    weight, reference = random_blocks(qtype, 208, cols, seed=rows)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 0.0  # an all-zero block
    x[-1, 32:64] *= 1e4  # one large block beside small ones
    _check(weight, reference, x)
    # Ordinary activations: the digits' rounding stays below float32's own, so the
    # results are held to the float GEMV's bound alone.
    error = (_exact(_interleaved(weight), x).double() - x.double() @ reference.double().T).abs()
    assert (error <= 2e-6 * (x.abs().double() @ reference.abs().double().T) + 1e-30).all()


@pytest.mark.parametrize("qtype", TYPES)
def test_values_far_below_their_blocks_largest(qtype: T) -> None:
    """One value 2^20 times its block's others (an outlier channel: the small values are
    rounded at 2^-31 of it), a block spanning float32's range, tiny and subnormal rows,
    a value near float32's largest: within the bound."""
    weight, reference = random_blocks(qtype, 64, 256, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 256, generator=g)
    x[0, 7] = 2.0**20
    x[1, :32] = torch.logspace(-30, 30, 32)
    x[1, 1::2] *= -1
    x[2] *= 1e-30
    x[3] *= 1e-41  # subnormal: below 2^-126
    x[4, 100] = 3.0e38 / max(1.0, float(reference.abs().max()))  # near float32's largest
    _check(weight, reference, x)


@pytest.mark.parametrize("qtype", TYPES)
def test_extreme_quants(qtype: T) -> None:
    """Every quant at its range's end against x whose digits are all at theirs."""
    weight, _ = random_blocks(qtype, 16, 256, seed=0)
    if qtype == T.Q8_0:
        weight.qs.fill_(-128)
    elif qtype == T.Q6_K:  # repacked: q - 32 in -32..31
        weight.qs.fill_(-32)
    elif qtype == T.Q5_0:  # repacked: q - 16 in -16..15
        weight.qs.fill_(-16)
    else:  # both nibbles at 15
        weight.qs.fill_(0xFF)
    reference = weight.dequantize()
    x = torch.full((3, 256), -1.0 + 2.0**-23)
    x[1] = 1.0 - 2.0**-24
    x[2, ::2] = -(1.0 - 2.0**-24)
    _check(weight, reference, x)


@pytest.mark.parametrize("qtype", TYPES)
def test_non_finite_rows(qtype: T) -> None:
    """A row with inf or NaN gives non-finite outputs (the float GEMV's NaN or inf); the
    other rows are untouched."""
    weight = _interleaved(random_blocks(qtype, 48, 256, seed=5)[0])
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6))
    clean = _exact(weight, x)
    x[0, 3] = float("nan")
    x[2, 70] = float("inf")
    out = _exact(weight, x)
    assert not torch.isfinite(out[0]).any() and not torch.isfinite(out[2]).any()
    assert torch.equal(out[1], clean[1])


@pytest.mark.parametrize("model", [None, GEMMA3], ids=["smollm2", "gemma3"])
def test_packaged_files_tensors(model: str | None) -> None:
    """SmolLM2's Q4_1 and Q8_0 and Gemma 3's Q8_0, Q5_0, Q4_K and Q6_K tensors."""
    check_packaged_tensors(model, tuple(TYPES), _check, (1, 3, 4, 17))


@pytest.mark.parametrize("qtype", TYPES)
def test_rows_are_identical_across_thread_counts(qtype: T) -> None:
    """Threads split the groups of 16 outputs, each summed whole on one thread in one
    order: a row's outputs are the same bits on 1 and 2 threads, alone and in every tile
    of x rows."""
    weight = _interleaved(random_blocks(qtype, 16 * 37, 768, seed=7)[0])
    x = torch.randn(9, 768, generator=torch.Generator().manual_seed(9))
    assert_rows_independent_of_threads(lambda rows: _exact(weight, rows), x, (1, 2, 3, 4, 5))


def test_lossless_method_interleaves_its_blocks() -> None:
    """prepare_kernels interleaves the lossless method's plain blocks of a multiple of 16
    rows in place (no copy kept: the same bytes), the repacked k-quants too; gguf_int8
    keeps its own arithmetic (the k-quants, which have no int8 kernel, the digit matmul)
    and other row counts their layout. Every row looks up (dequantize_rows) as the plain layout's."""
    for qtype in TYPES:
        plain, _ = random_blocks(qtype, 48, 256, seed=8)
        weight, _ = random_blocks(qtype, 48, 256, seed=8)
        weight.prepare_kernels("gguf")
        assert weight.interleaved and weight.packed is None
        # the same bytes reordered; Q5_0's 5 bits a quant (22 bytes a block) where Q8_0 has
        # 34, Q6_K's 6 (26.25 bytes per 32 weights) where its byte quants take 34.25
        shrunk = {T.Q5_0: (22, 34), T.Q6_K: (2625, 3425)}.get(qtype, (1, 1))
        assert weight.nbytes * shrunk[1] == plain.nbytes * shrunk[0]
        assert weight.five_bit == (qtype == T.Q5_0)
        assert weight.six_bit == (qtype == T.Q6_K)
        ids = torch.tensor([0, 15, 16, 47, 3, 3])
        assert torch.equal(weight.dequantize_rows(ids), plain.dequantize_rows(ids))
        x = torch.randn(2, 256, generator=torch.Generator().manual_seed(1))
        assert torch.equal(weight.linear(x), _exact(_interleaved(plain), x))
        int8, _ = random_blocks(qtype, 48, 256, seed=8)
        int8.prepare_kernels("gguf_int8")
        assert int8.int8_activations != (qtype in K_QUANTS)
        assert int8.interleaved == (qtype in K_QUANTS)
        odd, _ = random_blocks(qtype, 40, 256, seed=8)
        odd.prepare_kernels("gguf")
        assert not odd.interleaved


# Kind with the file's fields, kind with float32 scales, and their bytes per 32 weights.
COMPACT = {T.Q4_K: (13, 10, 18.5, 24), T.Q6_K: (15, 11, 26.25, 40)}
# Bytes per 32 weights as loaded (Q6_K's quants one a byte, the file's fields).
LOADED_BYTES = {T.Q4_K: 18.5, T.Q6_K: 34.25}


def _float32_scales(weight: BlockWeight) -> BlockWeight:
    """Kind 10 or 11: the weight's float32 scales (kind 3 or 4), interleaved."""
    wide = weight.plain()
    assert wide is not weight and not wide.compact
    wide.use_interleaved()
    assert wide.kind == COMPACT[weight.qtype][1]
    return wide


def _byte_quants(weight: BlockWeight) -> BlockWeight:
    """Kind 14: plain compact Q6_K interleaved with its quants one a byte."""
    planes = _interleave(weight.qtype, *weight.planes, inverse=False, compact=True)
    byte_quants = BlockWeight(weight.qtype, *planes, interleaved=True, compact=True)
    assert byte_quants.kind == 14
    return byte_quants


def _same_as_float32_scales(weight: BlockWeight, reference: torch.Tensor, x: torch.Tensor) -> None:
    compact, wide = _interleaved(weight), _float32_scales(weight)
    assert compact.kind == COMPACT[weight.qtype][0]
    out = compact.linear(x)
    assert torch.equal(out, wide.linear(x))
    if weight.qtype == T.Q6_K:
        assert torch.equal(out, _byte_quants(weight).linear(x))
    assert torch.equal(compact.dequantize(), reference)


@pytest.mark.parametrize("qtype", list(COMPACT))
@pytest.mark.parametrize("rows", ROWS)
def test_file_fields_give_the_float32_scales_results_bit_for_bit(qtype: T, rows: int) -> None:
    """Kinds 13 and 15 form each block's scale and minimum from the file's fields as gguf
    does: exactly kinds 10-11's float32 values, so the same outputs bit for bit (at 256 rows
    both take the dense path on their dequantized rows), and Q6_K's 6-bit quants kind 14's
    exact integer sums, from 18.5 / 24 (Q4_K) and 26.25 / 40 (Q6_K) of the bytes; their rows
    look up as gguf dequantizes them."""
    weight, reference = random_blocks(qtype, 208, 768, seed=rows)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 0.0
    x[-1, 32:64] *= 1e4
    _same_as_float32_scales(weight, reference, x)
    compact, wide = _interleaved(weight), _float32_scales(weight)
    _, _, compact_bytes, wide_bytes = COMPACT[qtype]
    assert compact.nbytes * wide_bytes == wide.nbytes * compact_bytes
    assert compact.nbytes * LOADED_BYTES[qtype] == weight.nbytes * compact_bytes
    ids = torch.tensor([[0, 15], [16, 207], [100, 100]])
    assert torch.equal(compact.dequantize_rows(ids), reference[ids])
    assert torch.equal(compact.plain().dequantize(), reference)


def test_packaged_k_quants_give_the_float32_scales_results_bit_for_bit() -> None:
    """Gemma 3's Q4_K and Q6_K tensors."""
    check_packaged_tensors(GEMMA3, tuple(COMPACT), _same_as_float32_scales, (1, 3, 4, 17, 256))


@pytest.mark.parametrize("qtype", list(COMPACT))
def test_file_fields_reach_a_kernel_on_every_path(qtype: T) -> None:
    """prepare_kernels lays the file's fields out as kinds 13 and 15 for the digit matmul and
    expands them to kinds 3-4 everywhere else (rows not a multiple of 16, a screened LM
    head's plain layout); shards stack with their fields (fused layers), and a row-parallel
    shard's whole super-blocks (quantization._rank_blocks) load as the whole's columns."""
    weight, reference = random_blocks(qtype, 48, 512, seed=11)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(12))
    want = _float32_scales(weight).linear(x)
    for method in ("gguf", "gguf_int8"):
        prepared, _ = random_blocks(qtype, 48, 512, seed=11)
        prepared.prepare_kernels(method)
        assert prepared.kind == COMPACT[qtype][0] and not prepared.int8_activations
        assert torch.equal(prepared.linear(x), want)
    odd, odd_reference = random_blocks(qtype, 40, 512, seed=11)
    odd.prepare_kernels("gguf")
    assert not odd.interleaved and not odd.compact and odd.kind == COMPACT[qtype][1] - 7
    assert torch.equal(odd.dequantize(), odd_reference)
    head, _ = random_blocks(qtype, 48, 512, seed=11)
    head.prepare_kernels("gguf", interleave=False)
    assert head.kind == COMPACT[qtype][1] - 7 and torch.equal(head.dequantize(), reference)

    halves = [
        BlockWeight(weight.qtype, *(t[rows] for t in weight.planes), compact=True)
        for rows in (slice(0, 16), slice(16, 48))
    ]
    stacked = concat_rows(halves)
    assert isinstance(stacked, BlockWeight) and stacked.compact
    stacked.prepare_kernels("gguf")
    assert stacked.kind == COMPACT[qtype][0]
    assert torch.equal(stacked.linear(x), want)

    # A row-parallel layer's rank: columns [start, start + size) of each row, taken from
    # the file's bytes only as whole super-blocks (GGML_QUANT_SIZES' 256 weights), so the
    # shard's fields are the file's own; a split inside a super-block keeps float32.
    raw = random_raw(qtype, 48, 512, seed=11)
    rank = SimpleNamespace(tp_size=2, shard_range=lambda dim, shard_id: (1, 256, 256))
    shard = BlockWeight.from_raw(_rank_blocks(rank, raw, qtype, None), qtype)
    shard.prepare_kernels("gguf")
    assert shard.kind == COMPACT[qtype][0]
    assert torch.equal(shard.dequantize(), reference[:, 256:])
    inside = SimpleNamespace(tp_size=2, shard_range=lambda dim, shard_id: (1, 128, 256))
    assert _rank_blocks(inside, raw, qtype, None) is None


def test_six_bit_quants_at_every_value() -> None:
    """Kind 15's nibbles and masks hold every 6-bit quant (each value in every row, chunk
    and half) and give them back (the inverse reorder, the kernels' plain blocks); against
    x whose digits sit at their range's ends, kind 14's results bit for bit."""
    weight, _ = random_blocks(T.Q6_K, 32, 512, seed=13)
    g = torch.Generator().manual_seed(14)
    values = torch.arange(-32, 32, dtype=torch.int8).repeat(32 * 512 // 64)
    weight.qs.copy_(values[torch.randperm(values.numel(), generator=g)].reshape(32, 512))
    reference = weight.plain().dequantize()
    byte_quants = _byte_quants(weight)
    six_bit = _interleave_six_bit(byte_quants.qs, inverse=False)
    assert six_bit.shape == (32, 512 // 32 * 24)
    assert torch.equal(_interleave_six_bit(six_bit, inverse=True), byte_quants.qs)
    compact = _interleaved(weight)
    assert torch.equal(compact.dequantize(), reference)
    assert torch.equal(compact.plain().qs, weight.qs)
    x = torch.full((4, 512), -1.0 + 2.0**-23)
    x[1] = 1.0 - 2.0**-24
    x[2, ::2] = -(1.0 - 2.0**-24)
    x[3] = torch.randn(512, generator=g)
    for rows in (1, 2, 3, 4):
        assert torch.equal(compact.linear(x[:rows]), byte_quants.linear(x[:rows]))
