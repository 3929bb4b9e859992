"""What a step's hidden states become: the logits of the rows that sample (a generating
model), the vectors of the prompts that complete (a pooling model), or nothing on a
pipeline stage before the last, whose hidden states went on to the next stage.

The runner picks its head once, when it is built: the kind of model and the stage never
change, so the step does not ask again.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from kvserve.pooling_params import PoolerConfig
from kvserve.worker.prompt_pooler import PromptPooler

if TYPE_CHECKING:
    from kvserve.config import ModelConfig
    from kvserve.sample.spec_decode_metadata import SpecDecodeMetadata
    from kvserve.worker.input_batch import InputBatch
    from kvserve.worker.input_preparation import StepInputs
    from kvserve.worker.logits_runner import ComputesLogits

# (logits or None, req_id -> pooled vector of a prompt that completed this step)
HeadOutput = tuple[torch.Tensor | None, dict[str, list[float]]]


class OutputHead(ABC):
    @abstractmethod
    def compute(
        self,
        model: ComputesLogits,
        hidden_states: torch.Tensor,
        batch: InputBatch,
        inputs: StepInputs,
        spec_metadata: SpecDecodeMetadata | None,
    ) -> HeadOutput:
        """The logits are ``[S, V]``, one row per sampling row, or, in a step with drafts,
        the rows ``spec_metadata.logits_indices`` names; None when no row samples."""

    @abstractmethod
    def remove_requests(self, req_ids: set[str]) -> None:
        """Forget the per-request state of finished requests (the runner's one loop over
        request-state owners reaches the head here)."""

    def request_census(self) -> dict[str, int]:
        """Live per-request entries (none unless the head folds prompts)."""
        return {}


class IntermediateStageHead(OutputHead):
    """A pipeline stage before the last: the last stage computes logits and samples."""

    def compute(
        self,
        model: ComputesLogits,
        hidden_states: torch.Tensor,
        batch: InputBatch,
        inputs: StepInputs,
        spec_metadata: SpecDecodeMetadata | None,
    ) -> HeadOutput:
        return None, {}

    def remove_requests(self, req_ids: set[str]) -> None:
        pass  # keeps no per-request state


class LogitsHead(OutputHead):
    """A generating model: logits only for the positions whose next token is sampled or
    verified; projecting every prefill position onto the vocabulary would be wasted."""

    def compute(
        self,
        model: ComputesLogits,
        hidden_states: torch.Tensor,
        batch: InputBatch,
        inputs: StepInputs,
        spec_metadata: SpecDecodeMetadata | None,
    ) -> HeadOutput:
        if spec_metadata is not None:
            return _float32_logits(model, hidden_states[spec_metadata.logits_indices]), {}
        num_sample = len(inputs.sample_rows)
        if num_sample == len(hidden_states):
            # One token per row and every row samples (pure decode): the rows are the
            # logits rows already, and a gather would only copy them.
            return _float32_logits(model, hidden_states), {}
        if num_sample:
            return _float32_logits(model, hidden_states[inputs.logits_indices]), {}
        return None, {}  # only partial prefill chunks: nothing samples yet

    def remove_requests(self, req_ids: set[str]) -> None:
        pass  # keeps no per-request state


def _float32_logits(model: ComputesLogits, hidden_states: torch.Tensor) -> torch.Tensor:
    # A bfloat16/float16 model's logits are sampled in float32, as vLLM's sampler does:
    # softmax, top-p and logprobs in 8 mantissa bits would move ties and probabilities.
    # A no-op (no copy) for float32 models.
    return model.compute_logits(hidden_states).float()


class PoolingHead(OutputHead):
    """A pooling model: the prompt pooler folds each chunk; its partial folds are the
    per-request state, so a request finished mid-prompt must be forgotten here."""

    def __init__(self, config: PoolerConfig) -> None:
        self.prompt_pooler = PromptPooler(config)

    def compute(
        self,
        model: ComputesLogits,
        hidden_states: torch.Tensor,
        batch: InputBatch,
        inputs: StepInputs,
        spec_metadata: SpecDecodeMetadata | None,
    ) -> HeadOutput:
        return None, self.prompt_pooler.pool_step(hidden_states, batch, inputs)

    def remove_requests(self, req_ids: set[str]) -> None:
        self.prompt_pooler.remove_requests(req_ids)

    def request_census(self) -> dict[str, int]:
        return {"pooler_states": len(self.prompt_pooler.pending_req_ids())}


def make_output_head(model_config: ModelConfig, is_last_stage: bool) -> OutputHead:
    if not is_last_stage:
        return IntermediateStageHead()
    if model_config.is_pooling and model_config.pooler_config is not None:
        return PoolingHead(model_config.pooler_config)
    return LogitsHead()
