"""The greedy token of a block-weight LM head without computing every exact logit.

A single-stream decode step on a CPU spends a large share of its time in the LM head:
Gemma 3's tied 262,144 x 640 Q8_0 head is 178 of the 247 MB a token reads, and the exact
float32 arithmetic of the lossless path costs about twice what the bytes do. A greedy
request needs only the first index of the row's maximum, so the head runs in two passes:

1. gguf_int8's integer GEMV (the input quantized to int8 per 32 values) gives every
   logit approximately, with a proven bound on each row's error;
2. the exact float32 GEMV runs on the candidate rows only: those whose bound reaches the
   largest lower bound, a handful of the vocabulary on real models.

Every row whose exact logit could be the maximum is a candidate, and the candidates'
exact logits are those the full head gives bit for bit (the GEMV's output does not
depend on the other rows it computes), so the token is the full head's argmax, ties
and all.

The bound. The int8 input differs from x by at most half a quantization step per value:
|x_i - d_b q_i| <= (0.5 + 2.3e-5) d_b with d_b = max|x| over the block / 127 (the
float32 rounding of the scale and the product adds the small part). Over a row of the
weight that is sum_b d_b (0.5 + ...) L1_rb, L1_rb the block's sum of |w_i|. Both passes
also round in float32: at most (K + 2 nb + 128) u times the sum of the terms'
magnitudes, u = 2^-24 for K columns and nb blocks, whose terms per block are at most
32 * 3 * max|w| * max|x| (Q4_1's kernels add d q and m separately, each under
3 max|w|). So row r's error is at most sum_b c_rb a_b, a_b = max|x| of block b, with
c_rb = L1_rb (0.5001 / 127) + eps * 96 max_b|w|, precomputed at load.
The screen first uses the cheap per-row form max_b(a_b) * sum_b c_rb, then the block
form on the rows that pass it (a row's outlier activations would otherwise widen every
row's bound).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from kvserve import _custom_ops as ops

if TYPE_CHECKING:
    from kvserve.model_executor.layers.quantization import BlockWeight

__all__ = ["ENV_GREEDY_SCREEN", "GreedyScreen", "screen_wanted"]

# "1" / "0": the screen on / off whatever the build (tests run it on every CPU).
ENV_GREEDY_SCREEN = "KVSERVE_GREEDY_SCREEN"

# Kernel kinds with gguf_int8's integer GEMV on the plain layout (Q8_0, Q4_1, Q4_0 and
# their nibble planes); repacked Q4_K / Q6_K heads keep the exact head.
_INT8_KINDS = frozenset({0, 1, 2, 5, 6})
# The integer GEMV without the interleaved copy takes up to 3 rows of x.
MAX_ROWS = 3
# Beyond this share of the vocabulary the second pass would cost about what the exact
# head does (a random-weight model's flat logits): compute the whole head instead.
_MAX_CANDIDATE_SHARE = 1 / 8
# Rows per chunk when the bound's coefficients are computed at load (bounds the float32
# scratch to ~40 MB whatever the vocabulary).
_LOAD_CHUNK_WEIGHTS = 1 << 23


def screen_wanted() -> bool:
    """By default, where the build's integer GEMV costs less than its exact float one
    (AVX2 without AVX-512, ops.integer_gemv_is_cheaper): with AVX-512 the exact head
    already reads the weights at the memory's rate, and the screen's two passes would
    cost more than the one."""
    forced = os.environ.get(ENV_GREEDY_SCREEN, "")
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        raise ValueError(f"{ENV_GREEDY_SCREEN} must be 0 or 1, not {forced!r}")
    return ops.integer_gemv_is_cheaper()


class GreedyScreen:
    """The greedy tokens of ``x @ weight[:vocab].T`` for up to MAX_ROWS rows of x."""

    @staticmethod
    def supports(weight: BlockWeight) -> bool:
        """The lossless arithmetic on a kind the integer GEMV takes (gguf_int8's own
        head is already the integer one: nothing to screen)."""
        return weight.kind in _INT8_KINDS and not weight.int8_activations

    def __init__(self, weight: BlockWeight, vocab: int) -> None:
        if not self.supports(weight):
            raise ValueError(f"no integer screen for block kind {weight.kind}")
        self.weight = weight
        self.vocab = vocab
        rows, cols = weight.shape
        nb = cols // 32
        eps = (cols + 2 * nb + 128) * 2.0**-24
        coeffs = torch.empty(rows, nb)
        chunk = max(1, _LOAD_CHUNK_WEIGHTS // cols)
        qs, d, m = weight.planes
        for start in range(0, rows, chunk):
            end = min(rows, start + chunk)
            part = ops.dequantize_blocks(
                qs[start:end], d[start:end], m[start:end] if m.numel() else m, weight.kind
            )
            blocks = part.abs_().view(end - start, nb, 32)
            l1 = blocks.sum(dim=-1, dtype=torch.float64)
            biggest = blocks.amax(dim=-1).double()
            coeffs[start:end] = (l1 * (0.5001 / 127) + biggest * (96 * eps)).mul_(1.01).float()
        # [vocab, nb] per-block and [vocab] whole-row coefficients of the bound
        self.block_coeffs = coeffs[:vocab].contiguous()
        self.row_coeffs = coeffs[:vocab].sum(dim=1, dtype=torch.float64).mul_(1.001).float()

    def greedy_tokens(self, x: torch.Tensor) -> torch.Tensor | None:
        """int64 ``[R]`` for float32 ``x [R, K]``; None where the screen does not apply
        (more than MAX_ROWS rows, a non-finite value, too many candidates): the caller
        then computes the logits."""
        if not 0 < x.shape[0] <= MAX_ROWS:
            return None
        w = self.weight
        tokens = ops.greedy_screen(
            x,
            w.planes,
            w.kind,
            self.row_coeffs,
            self.block_coeffs,
            self.vocab,
            int(self.vocab * _MAX_CANDIDATE_SHARE),
        )
        return None if bool((tokens < 0).any()) else tokens
