"""Sampling: the Sampler, the per-batch sampling state and logits processors."""

from __future__ import annotations

from kvserve.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
from kvserve.sample.metadata import SamplingMetadata
from kvserve.sample.sampler import Sampler, SamplerOutput, compute_prompt_logprobs
from kvserve.sample.sampling_batch import SamplingBatch

__all__ = [
    "BatchUpdate",
    "LogitsProcessor",
    "MoveDirectionality",
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingMetadata",
    "compute_prompt_logprobs",
]
