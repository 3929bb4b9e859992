"""What the model runner returns to the scheduler each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvserve.protocol.kv_connector_output import KVConnectorOutput


class LogprobsLists(NamedTuple):
    """Per sampled position: token ids, logprobs and ranks of [sampled, top-1..top-k]."""

    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]

    def slice(self, start: int, end: int) -> LogprobsLists:
        return LogprobsLists(
            self.logprob_token_ids[start:end],
            self.logprobs[start:end],
            self.sampled_token_ranks[start:end],
        )


class LogprobsTensors(NamedTuple):
    """Same as LogprobsLists, as tensors: [N, k+1], [N, k+1], [N]."""

    logprob_token_ids: torch.Tensor
    logprobs: torch.Tensor
    selected_token_ranks: torch.Tensor

    def tolists(self) -> LogprobsLists:
        return LogprobsLists(
            self.logprob_token_ids.tolist(),
            self.logprobs.tolist(),
            self.selected_token_ranks.tolist(),
        )


@dataclass
class RunnerStepTimes:
    """Seconds the runner spent on one step, for the engine core's step-time totals."""

    prepare_inputs: float
    forward: float
    sample: float


@dataclass
class EncoderRunStats:
    """One step's encoder work on the worker (multimodal models)."""

    vision_tower_runs: int = 0
    ec_connector_loads: int = 0
    ec_connector_saves: int = 0


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # One list per request in req_ids: empty while a prefill chunk is still partial, and
    # with speculative decoding the accepted drafts plus one token.
    sampled_token_ids: list[list[int]]
    # Rows follow req_ids; None when no request in the batch asked for logprobs.
    logprobs: LogprobsLists | None = None
    # With several tokens per request: request index -> its first row in logprobs (rows of
    # a request are consecutive). None: row i is request i.
    logprobs_row_starts: list[int] | None = None
    # Drafts for the next step, one list per request in req_ids (None: no speculation).
    spec_token_ids: list[list[int]] | None = None
    # req_id -> prompt logprobs of the positions computed in this step (None if not asked).
    prompt_logprobs_dict: dict[str, LogprobsTensors | None] = field(default_factory=dict)
    # The KV connector's report (None without a connector, or when it has nothing to say).
    kv_connector_output: KVConnectorOutput | None = None
    # req_id -> the pooled vector of a pooling request whose prompt finished this step.
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
    # None for a step without a forward.
    step_times: RunnerStepTimes | None = None
    encoder_stats: EncoderRunStats | None = None


def empty_model_runner_output() -> ModelRunnerOutput:
    """The output of a step that sampled nothing (a fresh one: callers may fill it in)."""
    return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
