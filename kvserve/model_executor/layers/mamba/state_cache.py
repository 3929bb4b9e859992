"""A Mamba layer's view of its KV cache tensor: block ``i`` of the pool is one request's
state (conv state then SSM state, float32), whatever shape the tensor has for the
attention layers sharing it.

A shared tensor is ``[S, num_blocks, ...]`` (S = 2 for the CPU backend's K and V planes):
an attention block's page is its slice ``[:, i]``, so a state lives in the same slice,
split over the S planes, and never touches another block's bytes.
"""

from __future__ import annotations

import math

import torch


class MambaStateCache:
    def __init__(
        self,
        memory: torch.Tensor,
        num_blocks: int,
        conv_shape: tuple[int, ...],
        ssm_shape: tuple[int, ...],
    ) -> None:
        if memory.dim() < 2 or memory.shape[1] != num_blocks:
            raise ValueError(
                f"a Mamba state needs a [S, {num_blocks}, ...] tensor, got {memory.shape}"
            )
        pages = memory.view(memory.shape[0], num_blocks, -1)
        if pages.dtype != torch.float32:  # the state stays float32 in a float16 cache
            pages = pages.view(torch.uint8).view(torch.float32)
        self.pages = pages
        self.conv_shape = conv_shape
        self.ssm_shape = ssm_shape
        self.conv_numel = math.prod(conv_shape)
        self.ssm_numel = math.prod(ssm_shape)
        self.page_numel = pages.shape[0] * pages.shape[2]
        if self.conv_numel + self.ssm_numel > self.page_numel:
            raise ValueError(
                f"a Mamba state of {self.conv_numel + self.ssm_numel} floats does not fit a "
                f"page of {self.page_numel}"
            )

    def gather(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the states in ``block_ids``: conv ``[R, K-1, D]``, ssm ``[R, H, P, N]``."""
        num = block_ids.shape[0]
        flat = self.pages[:, block_ids].transpose(0, 1).reshape(num, self.page_numel)
        conv = flat[:, : self.conv_numel].view(num, *self.conv_shape)
        ssm = flat[:, self.conv_numel : self.conv_numel + self.ssm_numel]
        return conv, ssm.view(num, *self.ssm_shape)

    def scatter(self, block_ids: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        num = block_ids.shape[0]
        flat = torch.zeros(num, self.page_numel, dtype=torch.float32, device=self.pages.device)
        flat[:, : self.conv_numel] = conv.reshape(num, -1)
        flat[:, self.conv_numel : self.conv_numel + self.ssm_numel] = ssm.reshape(num, -1)
        self.pages[:, block_ids] = flat.view(num, self.pages.shape[0], -1).transpose(0, 1)


class NoStateCache(MambaStateCache):
    """Before initialize_kv_cache: any use is a bug (the no-op form of the binding)."""

    def __init__(self) -> None:
        pass

    def gather(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("Mamba state cache not bound (initialize_kv_cache)")

    def scatter(self, block_ids: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        raise RuntimeError("Mamba state cache not bound (initialize_kv_cache)")
