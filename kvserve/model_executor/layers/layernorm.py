"""RMSNorm with an optional fused residual add (the decoder-layer pattern)."""

from __future__ import annotations

from typing import overload

import torch
from torch import nn

from kvserve import _custom_ops as ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the compute dtype, as HF does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: ``norm(x)``. With it: ``(norm(x + residual), x + residual)``
        so the caller carries the un-normalised sum to the next layer. With the kernels
        the fused form works in place: ``x`` and ``residual`` are overwritten and returned
        (as in vLLM; the decoder layers own both tensors)."""
        if ops.use_for(x) and x.is_contiguous():
            if residual is None:
                out = torch.empty_like(x)
                ops.rms_norm(out, x, self.weight, self.eps)
                return out
            if residual.is_contiguous() and residual.dtype == x.dtype:
                ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
                return x, residual
        if residual is None:
            return self._norm(x)
        summed = x + residual
        return self._norm(summed), summed

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: scales by ``1 + weight`` (checkpoints store the offset from 1),
    computed in float32 and rounded once at the end, in HF's order of operations. It
    takes no fused residual: Gemma normalises the sublayer output before the add."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        # ``1 + weight`` in float32 (HF's factor, same bits), kept for the C++ kernel and
        # rebuilt when the loader writes ``weight`` in place (its version counter moves).
        self._scale: torch.Tensor | None = None
        self._scale_version = -1

    def kernel_scale(self) -> torch.Tensor:
        version = self.weight._version
        if self._scale is None or self._scale_version != version:
            self._scale = (1.0 + self.weight.float()).contiguous()
            self._scale_version = version
        return self._scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ops.use_for(x) and x.is_contiguous():
            # The kernel's w * (x * inv_rms) is HF's product in the other order; with
            # torch's ops the norm was ~40% of Gemma's prefill (four norms per layer
            # plus the per-head q/k norms).
            out = torch.empty_like(x)
            ops.rms_norm(out, x, self.kernel_scale(), self.eps)
            return out
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
