"""The lossless digit matmul on blocks interleaved 16 rows at a time (kinds 7-15,
csrc/block_gemm_exact.cpp: AVX-512 VNNI builds every kind, AVX2 builds the 4-bit ones,
8-10 and 13): x split exactly into int8 digits, the GGUF weights exactly. Its results
are the float32 product of gguf's own dequantized
weights within float32 rounding at 1-256 rows (the float GEMV's tolerance), on random
blocks of every kind it takes, on outlier, tiny, zero and non-finite inputs and on the
packaged files' tensors; the interleaved planes dequantize bit for bit as the plain ones;
a row's result never depends on the rows beside it or the thread count; the lossless
method uses it by default where the build has it. Q4_K and Q6_K with the file's scale
fields (kinds 13-14) give kinds 10-11's results bit for bit from fewer bytes, and Q6_K's
quants in 6 bits (kind 15) kind 14's from the file's own size. The 4-bit kinds' results
are a scalar reference's bit for bit (the same exact integer sums and float32
operations), so AVX2 and AVX-512 VNNI builds agree."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
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
    reason="a build without AVX-512 VNNI or AVX2 (the digit matmul's kernels)",
)

# Q5_0, Q4_K and Q6_K as loaded (Q5_0: Q8_0 planes, interleaved in 5 bits; Q4_K and Q6_K
# with the file's scale fields, kinds 13 and 15), and the kind each interleaves as.
DIGIT_KINDS = {T.Q8_0: 7, T.Q4_1: 8, T.Q4_0: 9, T.Q5_0: 12, T.Q4_K: 13, T.Q6_K: 15}
# The types this build's digit matmul takes.
TYPES = [qtype for qtype, kind in DIGIT_KINDS.items() if kind in ops.exact_packed_kinds()]
# Those whose quants are 4 bits: their results are _scalar_reference's bit for bit.
FOUR_BIT = [qtype for qtype in (T.Q4_1, T.Q4_0, T.Q4_K) if qtype in TYPES]
# 4: the kernel's tile of x rows (5, 9, 17: partial tiles after full ones); it serves up
# to 255 rows, 256 take block_linear's dense path on the interleaved planes' dequantized rows.
ROWS = [1, 2, 3, 4, 5, 9, 17, 64, 255, 256]


def _interleaved(weight: BlockWeight) -> BlockWeight:
    """A copy of a plain weight, interleaved."""
    copy = BlockWeight(
        weight.qtype, weight.qs.clone(), weight.d.clone(), weight.m.clone(), compact=weight.compact
    )
    copy.use_interleaved()
    assert copy.interleaved and copy.kind in ops.exact_packed_kinds()
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
            assert torch.equal(_fewest_rows(weight, x, i), out[i])


def _fewest_rows(weight: BlockWeight, x: torch.Tensor, i: int) -> torch.Tensor:
    """Row i of x's outputs from the smallest call that takes the kernel all of x takes:
    one row where the digit matmul takes all of x, else two (AVX2's float32 path)."""
    if x.shape[0] <= ops.digit_matmul_rows():
        return _exact(weight, x[i : i + 1])[0]
    first = min(i, x.shape[0] - 2)
    return _exact(weight, x[first : first + 2])[i - first]


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
    if x.shape[0] > ops.digit_matmul_rows():  # AVX2's float32 path: _check's bound
        return
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
    # AVX2 multiplies one row alone with the digits, several in float32: from two rows on.
    tiles = (1, 2, 3, 4, 5) if ops.digit_matmul_rows() >= x.shape[0] else (2, 3, 4, 5)
    assert_rows_independent_of_threads(lambda rows: _exact(weight, rows), x, tiles)


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
    for qtype in set(DIGIT_KINDS) - set(TYPES):  # kinds this build's digit matmul lacks
        weight, _ = random_blocks(qtype, 48, 256, seed=8)
        weight.prepare_kernels("gguf")
        assert not weight.interleaved


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


@pytest.mark.parametrize("qtype", [qtype for qtype in COMPACT if qtype in TYPES])
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
    types = tuple(qtype for qtype in COMPACT if qtype in TYPES)
    check_packaged_tensors(GEMMA3, types, _same_as_float32_scales, (1, 3, 4, 17, 256))


@pytest.mark.parametrize("qtype", [qtype for qtype in COMPACT if qtype in TYPES])
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


def _fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 a * b + c rounded once, as the kernels' fused multiply-adds: the product
    is exact in float64 and the sum is rounded to odd there (an inexact sum with an even
    last bit moves one ulp toward the exact one), which float32's rounding then leaves
    the single rounding of the exact sum."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c = c.astype(np.float64)
    s = p + c
    t = s - p
    error = (p - (s - t)) + (c - t)  # p + c = s + error exactly (TwoSum)
    inexact_even = (error != 0) & ((s.view(np.int64) & 1) == 0)
    s = np.where(inexact_even, np.nextafter(s, np.where(error > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def _scalar_reference(weight: BlockWeight, x: torch.Tensor) -> torch.Tensor:
    """The digit matmul's result for a 4-bit kind and finite x, computed as the kernels
    do: x's blocks as integers X = x 2^(30-e) (2^(e-1) <= max|x| < 2^e), each block's
    exact sum of X q (q - 8 for Q4_0) rounded once to float32 (the kernels join the
    digits' exact halves with one fused multiply-add), times the block's scale and x's
    2^(e-30) (one float32 product), then the minimum times x's block sum (32 float32 adds
    in order), multiply-added into each output in block order."""
    plain = weight.plain()
    rows, cols = plain.shape
    nb = cols // 32
    packed = plain.qs.numpy().reshape(rows, nb, 16)
    q = np.concatenate([packed & 15, packed >> 4], axis=-1).astype(np.int64)
    if plain.qtype == T.Q4_0:
        q -= 8
    d = plain.d.float().numpy().reshape(rows, nb)
    m = plain.m.float().numpy().reshape(rows, nb) if plain.m.numel() else None
    xb = x.numpy().reshape(x.shape[0], nb, 32)
    _, e = np.frexp(np.abs(xb).max(-1))
    e = np.maximum(e, -96)
    up = np.ldexp(np.float32(1), 30 - e).astype(np.float32)
    big_x = np.rint(xb * up[..., None]).astype(np.int64)  # float32 product, ties to even
    x_scale = np.ldexp(np.float32(1), e - 30).astype(np.float32)
    x_sum = np.zeros(xb.shape[:2], np.float32)
    for j in range(32):
        x_sum = x_sum + xb[..., j]
    exact = np.einsum("rbj,nbj->rnb", big_x, q)
    acc = np.zeros((x.shape[0], rows), np.float32)
    for b in range(nb):
        dot = exact[..., b].astype(np.float64).astype(np.float32)
        scale = (d[None, :, b].astype(np.float64) * x_scale[:, None, b]).astype(np.float32)
        acc = _fma32(dot, scale, acc)
        if m is not None:
            acc = _fma32(np.broadcast_to(m[None, :, b], acc.shape), x_sum[:, None, b], acc)
    return torch.from_numpy(acc)


def _same_as_reference(weight: BlockWeight, _: torch.Tensor, x: torch.Tensor) -> None:
    """Each row of x through the digit matmul (AVX2's takes one row at a time)."""
    want = _scalar_reference(weight, x)
    calls = [x] if x.shape[0] <= ops.digit_matmul_rows() else list(x.split(1))
    interleaved = _interleaved(weight)
    assert torch.equal(torch.cat([_exact(interleaved, rows) for rows in calls]), want)
    if weight.qtype == T.Q4_K:  # and kind 10, Q4_K's float32 scales
        got = torch.cat([_float32_scales(weight).linear(rows) for rows in calls])
        assert torch.equal(got, want)


@pytest.mark.parametrize("qtype", FOUR_BIT)
@pytest.mark.parametrize("rows", [1, 2, 5, 17, 100])
def test_four_bit_kinds_match_the_scalar_reference_bit_for_bit(qtype: T, rows: int) -> None:
    """Random blocks, with an all-zero, a tiny and a large block of x: the same bits as
    the scalar reference on every build (so AVX2's and AVX-512 VNNI's kernels agree)."""
    weight, reference = random_blocks(qtype, 208, 768, seed=rows)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 0.0
    x[-1, 32:64] *= 1e4
    x[-1, 64:96] *= 1e-30
    _same_as_reference(weight, reference, x)


@pytest.mark.parametrize("model", [None, GEMMA3], ids=["smollm2", "gemma3"])
def test_packaged_four_bit_tensors_match_the_scalar_reference(model: str | None) -> None:
    """SmolLM2's Q4_1 and Gemma 3's Q4_K tensors."""
    check_packaged_tensors(model, tuple(FOUR_BIT), _same_as_reference, (1, 3, 4))


@pytest.mark.skipif(
    T.Q6_K not in TYPES, reason="kind 15 is AVX-512 VNNI's (AVX2 builds never make it)"
)
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
