"""Greedy token choice: the index of each row's largest logit."""

from __future__ import annotations

import numpy as np
import torch


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """int64 [N]: the first index of each row's maximum in ``logits`` [N, V] (a NaN counts
    as the maximum), as ``logits.argmax(dim=-1)``.

    On a CPU, numpy's argmax: torch's reduction took 110-120 us for one row of a 49,152-token
    vocabulary against numpy's 12 (AMD EPYC Zen 3), ~1% of a single-stream step. Both keep
    the first of equal maxima."""
    cpu_floats = logits.is_cpu and logits.dtype in (torch.float32, torch.float64)
    if cpu_floats and logits.numel() and not logits.requires_grad:
        return torch.from_numpy(np.argmax(logits.numpy(), axis=-1).astype(np.int64, copy=False))
    return logits.argmax(dim=-1)
