"""Gemma 3's multimodal projector: a SigLIP image's patch outputs -> its soft tokens in the
language model's embedding space.

The patch grid (``image_size / patch_size`` per side) is average-pooled down to
``mm_tokens_per_image`` tokens (a square grid), normalised with Gemma's RMSNorm (scale
``1 + weight``) and multiplied by ``mm_input_projection_weight`` (``[vision hidden, text
hidden]``, applied as ``x @ W``, HF's orientation). Names are HF's
(``multi_modal_projector.*``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model_executor.layers.layernorm import GemmaRMSNorm


class Gemma3MultiModalProjector(nn.Module):
    def __init__(
        self,
        vision_hidden_size: int,
        text_hidden_size: int,
        patches_per_side: int,
        mm_tokens_per_image: int,
        eps: float,
    ) -> None:
        super().__init__()
        tokens_per_side = math.isqrt(mm_tokens_per_image)
        if tokens_per_side**2 != mm_tokens_per_image:
            raise ValueError(f"mm_tokens_per_image must be a square, got {mm_tokens_per_image}")
        if patches_per_side % tokens_per_side:
            raise ValueError(
                f"{patches_per_side} patches per side do not pool evenly to {tokens_per_side}"
            )
        self.patches_per_side = patches_per_side
        self.kernel_size = patches_per_side // tokens_per_side
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(vision_hidden_size, text_hidden_size), requires_grad=False
        )
        self.mm_soft_emb_norm = GemmaRMSNorm(vision_hidden_size, eps)

    def forward(self, vision_outputs: torch.Tensor) -> torch.Tensor:
        """``[images, patches, vision hidden]`` -> ``[images, mm_tokens_per_image, text hidden]``."""
        images, _, hidden = vision_outputs.shape
        side = self.patches_per_side
        grid = vision_outputs.transpose(1, 2).reshape(images, hidden, side, side).contiguous()
        pooled = F.avg_pool2d(grid, self.kernel_size, self.kernel_size).flatten(2).transpose(1, 2)
        normed = self.mm_soft_emb_norm.forward(pooled.contiguous())
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(vision_outputs)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name not in params or params[name].shape != tensor.shape:
                raise ValueError(f"unexpected projector weight {name!r} {tuple(tensor.shape)}")
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        if loaded != set(params):
            raise ValueError(f"projector weights missing: {sorted(set(params) - loaded)}")
        return loaded
