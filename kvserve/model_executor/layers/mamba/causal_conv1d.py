"""The Mamba mixer's depthwise causal conv1d, resumable: the state is the last
``kernel - 1`` inputs before the tokens at hand (zeros before a sequence's start, the
same as the zero padding of a conv over the whole sequence)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_fn(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's chunk: ``x [T, D]`` after ``conv_state [K-1, D]`` (weight ``[D, K]``)
    -> (output ``[T, D]`` before the activation, the state after the chunk ``[K-1, D]``)."""
    num_tokens, channels = x.shape
    full = torch.cat([conv_state, x], dim=0)  # [K-1+T, D]
    out = F.conv1d(full.t().unsqueeze(0), weight.unsqueeze(1), bias, groups=channels)
    new_state = full[full.shape[0] - conv_state.shape[0] :]
    return out[0].t()[:num_tokens], new_state


def causal_conv1d_update(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of R sequences: ``x [R, D]``, ``conv_state [R, K-1, D]`` ->
    (output ``[R, D]`` before the activation, the new states ``[R, K-1, D]``)."""
    window = torch.cat([conv_state, x.unsqueeze(1)], dim=1)  # [R, K, D]
    out = torch.einsum("rkd,dk->rd", window, weight)
    if bias is not None:
        out = out + bias
    return out, window[:, 1:]
