"""Greedy steps that skip the logits: the model's greedy screen (greedy_screen.py) gives
the sampled tokens straight from the hidden states when the Sampler would return the
logits' argmax and nothing else. The step's logits are then never built.

Chosen once, when the model is loaded: a model without a screen (no greedy_tokens, or
float32 weights, or gguf_int8, or tensor parallelism) gets the no-op.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

from kvserve.model_executor.layers.greedy_screen import MAX_ROWS
from kvserve.sample.sampler import argmax_suffices

if TYPE_CHECKING:
    from kvserve.sample.spec_decode_metadata import SpecDecodeMetadata
    from kvserve.worker.input_batch import InputBatch
    from kvserve.worker.input_preparation import StepInputs


class GreedyHead(ABC):
    @abstractmethod
    def tokens(
        self,
        hidden_states: torch.Tensor,
        batch: InputBatch,
        inputs: StepInputs,
        spec_metadata: SpecDecodeMetadata | None,
    ) -> torch.Tensor | None:
        """int64 ``[S]``: the sampling rows' tokens, exactly what the Sampler would give
        from the logits; None: compute the logits (and sample them)."""


class NoGreedyHead(GreedyHead):
    def tokens(
        self,
        hidden_states: torch.Tensor,
        batch: InputBatch,
        inputs: StepInputs,
        spec_metadata: SpecDecodeMetadata | None,
    ) -> torch.Tensor | None:
        return None


class ScreenedGreedyHead(GreedyHead):
    """A step of a few sampling rows, all greedy, with nothing that reads the logits
    besides the argmax: no drafts to verify, no grammar, logprobs, penalties or
    argmax-moving processors."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def tokens(
        self,
        hidden_states: torch.Tensor,
        batch: InputBatch,
        inputs: StepInputs,
        spec_metadata: SpecDecodeMetadata | None,
    ) -> torch.Tensor | None:
        sample_rows = inputs.sample_rows
        if spec_metadata is not None or not 0 < len(sample_rows) <= MAX_ROWS:
            return None
        requests = batch.requests
        for row in sample_rows.tolist():
            request = requests[row]
            if request is None or request.sampling_params.structured_outputs is not None:
                return None
        num_reqs = batch.num_reqs
        rows = None if len(sample_rows) == num_reqs else torch.from_numpy(sample_rows)
        # The Sampler is not called in a step this head serves: this is the step's one
        # make_sampling_metadata (which also brings the logits processors up to date).
        if not argmax_suffices(batch.sampling_batch.make_sampling_metadata(num_reqs, rows)):
            return None
        if len(sample_rows) != len(hidden_states):
            hidden_states = hidden_states[inputs.logits_indices]
        return self.model.greedy_tokens(hidden_states)


NO_GREEDY_HEAD = NoGreedyHead()


def make_greedy_head(model: Any, is_last_stage: bool, is_pooling: bool) -> GreedyHead:
    screened = any(getattr(m, "greedy_screen", None) is not None for m in model.modules())
    if not is_last_stage or is_pooling or not screened or not hasattr(model, "greedy_tokens"):
        return NO_GREEDY_HEAD
    return ScreenedGreedyHead(model)
