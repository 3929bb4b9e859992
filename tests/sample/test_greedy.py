"""greedy_tokens is torch's argmax, row by row, whatever the layout and the values."""

from __future__ import annotations

import pytest
import torch

from kvserve.sample.ops.greedy import greedy_tokens

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "logits",
    [
        torch.randn(1, 49152),
        torch.randn(9, 1000, dtype=torch.float64),
        torch.randn(6, 100)[:, ::3],  # strided rows
        torch.randn(100, 6).t(),  # column-major
        torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]]),  # ties: the first
        torch.tensor([[NAN, 1.0, NAN], [1.0, INF, 2.0], [-INF, -INF, -INF]]),
        torch.empty(0, 7),
        torch.randn(3, 5, dtype=torch.bfloat16),  # not float32/64: torch's own argmax
    ],
)
def test_greedy_tokens_equal_argmax(logits: torch.Tensor) -> None:
    with torch.inference_mode():
        chosen = greedy_tokens(logits)
    assert chosen.dtype == torch.int64
    assert torch.equal(chosen, logits.argmax(dim=-1))
