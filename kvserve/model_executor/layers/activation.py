"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import _custom_ops as ops


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` for the fused gate/up projection output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        if ops.use_for(x) and x.is_contiguous():
            out = x.new_empty((*x.shape[:-1], d))
            ops.silu_and_mul(out, x)
            return out
        return F.silu(x[..., :d]) * x[..., d:]


class GeluAndMul(nn.Module):
    """``gelu(x[..., :d]) * x[..., d:]``; ``approximate="tanh"`` is Gemma's
    ``gelu_pytorch_tanh``."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        if self.approximate == "tanh" and ops.use_for(x) and x.is_contiguous():
            # The row kernel the fused decode stack runs too, so both round alike.
            out = x.new_empty((*x.shape[:-1], d))
            ops.gelu_tanh_and_mul(out, x)
            return out
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]
