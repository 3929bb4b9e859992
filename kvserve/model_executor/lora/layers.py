"""A projection with LoRA adapters applied to the rows of a batch, each row its own.

Every wrapped projection keeps all resident adapters stacked (punica's layout, in torch):
``lora_a`` is ``[in, S*L*R]`` and ``lora_b`` is ``[S*L*R, out]`` for ``S`` sub-projections
(q/k/v of a fused QKV, gate/up of a fused MLP), ``L`` adapter slots and rank ``R``
(smaller ranks are zero-padded; ``lora_b`` is block-diagonal over the sub-projections and
carries the adapter's scaling). A step then costs two matmuls per projection whatever the
mix of adapters: ``x @ lora_a``, a per-token mask that keeps only the token's own slot
(all zero for tokens of the base model), and ``@ lora_b`` added to the base output. No
Python loop over requests or adapters runs inside the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvserve.model_executor.layers.linear import LinearBase


@dataclass
class LoRAStepState:
    """Shared by every LoRA layer of a model; the runner sets it before each forward.

    ``token_mask``: float ``[T, L]``, 1 where token t runs through slot l; None when no
    token of the step uses an adapter (the layers then cost nothing extra).
    """

    token_mask: torch.Tensor | None = None


class LoRALinear(nn.Module):
    lora_a: torch.Tensor
    lora_b: torch.Tensor

    def __init__(
        self,
        base_layer: LinearBase,
        output_slices: list[int],
        max_loras: int,
        max_rank: int,
        state: LoRAStepState,
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.output_slices = output_slices
        self.slice_offsets = [sum(output_slices[:i]) for i in range(len(output_slices))]
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.state = state
        width = len(output_slices) * max_loras * max_rank
        # The declared sizes, not weight.shape: a quantized layer's weight is a placeholder
        # (its GGUF blocks do the matmul); the adapters stay float32.
        in_features = getattr(base_layer, "input_size_per_partition", base_layer.input_size)
        device = base_layer.weight.device
        # Buffers, not parameters: adapters come and go at run time, never from a checkpoint.
        self.register_buffer("lora_a", torch.zeros(in_features, width, device=device))
        self.register_buffer("lora_b", torch.zeros(width, sum(output_slices), device=device))

    def _columns(self, sub: int, slot: int) -> slice:
        start = (sub * self.max_loras + slot) * self.max_rank
        return slice(start, start + self.max_rank)

    def reset_slot(self, slot: int) -> None:
        for sub in range(len(self.output_slices)):
            cols = self._columns(sub, slot)
            self.lora_a[:, cols] = 0
            self.lora_b[cols, :] = 0

    def set_lora(
        self,
        slot: int,
        sub: int,
        lora_a: torch.Tensor | None = None,
        lora_b: torch.Tensor | None = None,
        scaling: float = 1.0,
    ) -> None:
        """PEFT's ``lora_A`` (``[r, in]``) and ``lora_B`` (``[out_sub, r]``) of one
        sub-projection into ``slot``; the scaling goes into B."""
        cols = self._columns(sub, slot)
        if lora_a is not None:
            rank = lora_a.shape[0]
            self._check(lora_a.shape[1], self.lora_a.shape[0], rank, "lora_A input size")
            self.lora_a[:, cols.start : cols.start + rank] = lora_a.T.to(self.lora_a)
        if lora_b is not None:
            rank = lora_b.shape[1]
            size, offset = self.output_slices[sub], self.slice_offsets[sub]
            self._check(lora_b.shape[0], size, rank, "lora_B output size")
            rows = slice(cols.start, cols.start + rank)
            self.lora_b[rows, offset : offset + size] = (lora_b.T * scaling).to(self.lora_b)

    def _check(self, got: int, expected: int, rank: int, what: str) -> None:
        if got != expected:
            raise ValueError(f"{self.base_layer.prefix}: {what} {got} != the model's {expected}")
        if rank > self.max_rank:
            raise ValueError(f"LoRA rank {rank} is larger than max_lora_rank={self.max_rank}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer.forward(x)
        mask = self.state.token_mask
        if mask is None:
            return out
        num_tokens = x.shape[0]
        shrunk = (x @ self.lora_a).view(num_tokens, len(self.output_slices), self.max_loras, -1)
        shrunk = shrunk * mask[:, None, :, None]
        return out.addmm_(shrunk.view(num_tokens, -1), self.lora_b)

    def extra_repr(self) -> str:
        return f"slices={self.output_slices}, max_loras={self.max_loras}, rank={self.max_rank}"
