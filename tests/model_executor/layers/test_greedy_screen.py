"""The greedy screen (greedy_screen.py): the first index of each row's largest exact logit
of a block-weight head, through the integer GEMV and an exact pass over the candidates.
On random heads of every kind it takes, with ordinary inputs, an outlier channel and
tiny ones: the full exact head's argmax, and every row's integer-pass error within its
bound; ties go to the first row; where it cannot answer it says so (None). Run it with
``KVSERVE_MARCH=haswell`` too for the AVX2 build's kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from kvserve import _custom_ops as ops
from kvserve.model_executor.layers.block_weight import BlockWeight
from kvserve.model_executor.layers.greedy_screen import (
    ENV_GREEDY_SCREEN,
    MAX_ROWS,
    GreedyScreen,
    screen_wanted,
)
from tests.kernel_support import require_kernels
from tests.model_executor.test_gguf_repack import _random_raw

require_kernels()

COLS = 640
K_COLS = 768  # k-quant super-blocks hold 256 weights
K_QUANTS = (T.Q4_K, T.Q6_K)
ROWS = 3000
VOCAB = 2990  # a padded head: rows past the vocabulary never count


def _head(qtype: T, seed: int, nibble_planes: bool = False, rows: int = ROWS) -> BlockWeight:
    if qtype in K_QUANTS:  # random blocks (both signs of scales and minimums), repacked
        head = BlockWeight.from_raw(_random_raw(qtype, rows, K_COLS, seed), qtype)
        head.prepare_kernels("gguf", interleave=False)  # a screened head's float32 scales
        return head
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((rows, COLS)) * 0.05).astype(np.float32)
    weight[rows - 1] = 1.0  # past the vocabulary: the largest logit of a positive x
    w = BlockWeight.from_raw(quantize(weight, qtype), qtype)
    if nibble_planes:
        w.use_nibble_planes()
        assert w.nibble_planes
    return w


def _inputs(seed: int, cols: int = COLS) -> list[torch.Tensor]:
    """1-3 rows each: ordinary activations, one outlier channel, tiny values, a mix."""
    g = torch.Generator().manual_seed(seed)
    ordinary = torch.randn(3, cols, generator=g)
    outlier = torch.randn(2, cols, generator=g)
    outlier[:, 17] = 300.0
    tiny = torch.randn(1, cols, generator=g) * 1e-30
    positive = torch.rand(2, cols, generator=g) + 0.5
    return [ordinary[:1], ordinary, outlier, tiny, positive]


def _exact(w: BlockWeight, x: torch.Tensor) -> torch.Tensor:
    return ops.block_linear(x, w.qs, w.d, w.m, w.kind)[:, :VOCAB]


KINDS = [
    (T.Q8_0, False),
    (T.Q4_1, False),
    (T.Q4_0, False),
    (T.Q4_1, True),
    (T.Q4_0, True),
    (T.Q4_K, False),  # repacked: kind 3
    (T.Q6_K, False),  # kind 4
]


@pytest.mark.parametrize(("qtype", "planes"), KINDS)
def test_tokens_are_the_exact_heads_argmax(qtype: T, planes: bool) -> None:
    w = _head(qtype, seed=3, nibble_planes=planes)
    screen = GreedyScreen(w, VOCAB)
    for x in _inputs(seed=4, cols=w.shape[1]):
        tokens = screen.greedy_tokens(x)
        assert tokens is not None
        want = np.argmax(_exact(w, x).numpy(), axis=-1)
        assert tokens.tolist() == want.tolist()


@pytest.mark.parametrize(("qtype", "planes"), KINDS)
def test_integer_pass_error_within_the_bound(qtype: T, planes: bool) -> None:
    w = _head(qtype, seed=5, nibble_planes=planes)
    screen = GreedyScreen(w, VOCAB)
    for x in _inputs(seed=6, cols=w.shape[1]):
        approx = ops.greedy_screen_approx(x, w.planes, w.kind)[:, :VOCAB]
        block_max = x.abs().reshape(len(x), -1, 32).amax(dim=-1)
        bound = block_max.double() @ screen.block_coeffs.double().T
        error = (_exact(w, x).double() - approx.double()).abs()
        assert bool((error <= bound).all())
        assert bool((screen.row_coeffs.double() >= screen.block_coeffs.double().sum(1)).all())
        # Not vacuous: the bound is within a few times the worst error seen.
        assert float((bound / error.clamp_min(1e-30)).min()) < 50


def test_equal_rows_give_the_first() -> None:
    w = _head(T.Q8_0, seed=7)
    row = 40
    for copy in (900, 12):  # a later copy, then an earlier one
        w.qs[copy], w.d[copy] = w.qs[row], w.d[row]
    x = w.dequantize()[row : row + 1].clone()  # row 40's own direction: its logit is largest
    tokens = GreedyScreen(w, VOCAB).greedy_tokens(x)
    assert tokens is not None and tokens.tolist() == [12]
    assert int(np.argmax(_exact(w, x).numpy())) == 12


def test_declines_what_it_cannot_screen() -> None:
    w = _head(T.Q8_0, seed=8)
    screen = GreedyScreen(w, VOCAB)
    x = torch.randn(MAX_ROWS + 1, COLS)
    assert screen.greedy_tokens(x) is None  # too many rows for the integer GEMV
    assert screen.greedy_tokens(torch.zeros(1, COLS)) is None  # every logit ties
    for bad in (float("nan"), float("inf")):
        y = torch.randn(1, COLS)
        y[0, 5] = bad
        assert screen.greedy_tokens(y) is None
    same = _head(T.Q8_0, seed=9, rows=64)
    same.qs[:], same.d[:] = same.qs[0].clone(), same.d[0].clone()  # all rows equal
    assert GreedyScreen(same, 64).greedy_tokens(torch.randn(1, COLS)) is None


def test_screen_only_on_the_lossless_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _head(T.Q8_0, seed=10)
    assert GreedyScreen.supports(w)
    w.use_int8_activations()  # gguf_int8's head is the integer GEMV already
    assert not GreedyScreen.supports(w)
    with pytest.raises(ValueError, match="no screen"):
        GreedyScreen(w, VOCAB)
    w = _head(T.Q8_0, seed=10, rows=ROWS - ROWS % 16)
    w.use_interleaved()  # the digit matmul's head (Q8_0: AVX-512 VNNI builds only)
    assert w.interleaved == (7 in ops.exact_packed_kinds())
    assert GreedyScreen.supports(w) == (not w.interleaved)
    monkeypatch.setenv(ENV_GREEDY_SCREEN, "1")
    assert screen_wanted()
    monkeypatch.setenv(ENV_GREEDY_SCREEN, "0")
    assert not screen_wanted()
    monkeypatch.delenv(ENV_GREEDY_SCREEN)
    assert screen_wanted() == ops.integer_gemv_is_cheaper()
    monkeypatch.setenv(ENV_GREEDY_SCREEN, "yes")
    with pytest.raises(ValueError, match=ENV_GREEDY_SCREEN):
        screen_wanted()
