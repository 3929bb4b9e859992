"""The greedy token of a block-weight LM head without computing every exact logit.

A single-stream decode step on a CPU spends a large share of its time in the LM head:
Gemma 3's tied 262,144 x 640 Q8_0 head is 178 of the 247 MB a token reads, and the exact
float32 arithmetic of the lossless path costs about twice what the bytes do. A greedy
request needs only the first index of the row's maximum, so the head runs in two passes:

1. gguf_int8's integer arithmetic (the input quantized to int8 per 32 values) gives
   every logit approximately, with a proven bound on each row's error;
2. the exact float32 GEMV runs on the candidate rows only: those whose bound reaches the
   largest lower bound, a handful of the vocabulary on real models.

Every row whose exact logit could be the maximum is a candidate, and the candidates'
exact logits are those the full head gives bit for bit (the GEMV's output does not
depend on the other rows it computes), so the token is the full head's argmax, ties
and all. The selection and the exact pass are one kernel call (csrc/greedy_screen.cpp).

The bound. The int8 input differs from x by at most half a quantization step per value:
|x_i - d_b q_i| <= (0.5 + 2.3e-5) d_b with d_b = a_b / 127, a_b = max|x| over block b
(the float32 rounding of the scale and the product adds the small part). Over a row of
the weight that is at most sum_b a_b (0.5001 / 127) L1_rb, L1_rb the block's sum of
|w_i|. Both passes also round in float32: at most eps = (K + 2 nb + 128) u times the sum
of the terms' magnitudes (u = 2^-24, K columns, nb blocks). The kernels add a block's
d q_i x_i and m x_i separately (a minimum's kinds), and |d q_i| <= |w_i| + |m|, so those
magnitudes are at most (L1_rb + 64 |m_b|) a_b. Row r's error is therefore at most
sum_b c_rb a_b with c_rb = 1.01 (L1_rb 0.5001 / 127 + eps (L1_rb + 64 |m_b|)),
precomputed at load (1% for the float32 rounding of the coefficients themselves).
The screen first uses the cheap per-row form max_b(a_b) sum_b c_rb, then the block form
on the rows that pass it (one outlier activation would otherwise widen every row's
bound).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from kvserve import _custom_ops as ops

if TYPE_CHECKING:
    from kvserve.model_executor.layers.block_weight import BlockWeight

__all__ = ["ENV_GREEDY_SCREEN", "GreedyScreen", "screen_wanted"]

# "1" / "0": the screen on / off whatever the build (tests run it on every CPU).
ENV_GREEDY_SCREEN = "KVSERVE_GREEDY_SCREEN"

# Rows of x per call: gguf_int8's integer GEMV on the plain layout takes up to 3.
MAX_ROWS = 3
# Beyond this share of the vocabulary the second pass would cost about what the exact
# head does (a random-weight model's flat logits): compute the whole head instead.
_MAX_CANDIDATE_SHARE = 1 / 8


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
        """The lossless arithmetic on the plain layout (gguf_int8's own head is already
        the integer one: nothing to screen; the interleaved head's digit matmul, AVX-512
        VNNI, costs less than the screen's two passes)."""
        return not weight.int8_activations and not weight.interleaved

    def __init__(self, weight: BlockWeight, vocab: int) -> None:
        if not self.supports(weight):
            raise ValueError(
                "no screen: gguf_int8's head is the integer GEMV already, an interleaved "
                "head the digit matmul (screen its plain() copy)"
            )
        self.weight = weight
        self.vocab = vocab
        # [vocab, nb] per-block and [vocab] whole-row coefficients of the bound
        self.block_coeffs, self.row_coeffs = ops.greedy_screen_coeffs(
            weight.planes, weight.kind, vocab
        )

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
