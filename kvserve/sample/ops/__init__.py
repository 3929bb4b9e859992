"""Batched tensor kernels of the sampler (penalties, top-k/top-p, logprobs)."""

from __future__ import annotations
