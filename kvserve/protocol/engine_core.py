"""Requests into and outputs out of the engine core (msgspec, so they cross processes)."""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from kvserve.lora.request import LoRARequest
from kvserve.pooling_params import PoolingParams
from kvserve.protocol.kv_events import KVEvent
from kvserve.protocol.mm_inputs import MultiModalFeatureSpec
from kvserve.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    # A pooling request (returns a vector, samples nothing) / the LoRA adapter it runs with.
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None
    # Images etc. in prompt order; an item the core's processor cache holds comes
    # without its data (kvserve/multimodal/processor_cache.py).
    mm_features: list[MultiModalFeatureSpec] | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    request_id: str
    new_token_ids: list[int]
    # [sampled, top-k...] ids and logprobs per new token, and the sampled token's rank.
    new_logprobs_token_ids: list[list[int]] | None = None
    new_logprobs: list[list[float]] | None = None
    new_sampled_token_ranks: list[int] | None = None
    # Prompt logprobs for the prompt positions computed in this step (same layout).
    new_prompt_logprobs_token_ids: list[list[int]] | None = None
    new_prompt_logprobs: list[list[float]] | None = None
    new_prompt_logprobs_ranks: list[int] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    # A pooling request's vector, with its final output.
    pooling_output: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StepTimes(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Running totals of the engine core's seconds per step phase since it started.

    Totals rather than per-step values: a stats message that is dropped or taken out of
    band (get_stats) loses nothing, and the receiver turns them into counter increments.
    """

    schedule: float = 0.0
    # The runner's state update, input preparation and attention metadata build.
    prepare_inputs: float = 0.0
    # The model forward and compute_logits (with a device sync on accelerators).
    forward: float = 0.0
    sample: float = 0.0
    # scheduler.update_from_output.
    update: float = 0.0
    # Whole steps: the phases plus the glue between them (executor calls, KV events).
    busy: float = 0.0
    num_steps: int = 0


# The engine-core phases of a step, in order (output processing is the front end's).
STEP_PHASES = ("schedule", "prepare_inputs", "forward", "sample", "update")


class SpecDecodingStats(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Running totals of speculative decoding since the engine started (vLLM's names).

    A draft is one request's drafts verified in one step; num_accepted_tokens_per_pos[i]
    counts the drafts whose (i+1)-th token was accepted. Totals, like StepTimes: the
    receiver turns them into counter increments.
    """

    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verified draft: the accepted ones plus the one the target adds."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class MultiModalStats(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Running totals of the engine core's multimodal caches since it started.

    An encoder cache query is an item a prompt chunk needed; a hit found its output
    cached (another request's, or its own from an earlier chunk). Vision tower runs count
    images encoded; the encoder cache connector's loads are images it did not encode.
    Processor cache hits are items that crossed the socket as their hash alone (counted
    by the core's mirror of the front end's cache, which sees the same hits)."""

    processor_cache_queries: int = 0
    processor_cache_hits: int = 0
    encoder_cache_queries: int = 0
    encoder_cache_hits: int = 0
    vision_tower_runs: int = 0
    ec_connector_loads: int = 0
    ec_connector_saves: int = 0


class SchedulerStats(msgspec.Struct, omit_defaults=True, kw_only=True):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    # Blocks held by requests (the null block excluded): 0 once all are done, or a leak.
    kv_cache_blocks_in_use: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # Running totals from the KV connector, {metric: {label: value}} (e.g. tier hits).
    kv_connector_stats: dict[str, dict[str, float]] | None = None
    step_times: StepTimes | None = None
    spec_decoding_stats: SpecDecodingStats | None = None
    mm_stats: MultiModalStats | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    # Requests the core finished on its own (e.g. aborted by a stop string in the front end).
    finished_requests: set[str] | None = None
    # Wall-clock time at which requests were first scheduled, for those first scheduled
    # since the last outputs (the queue-time metric).
    scheduled_times: dict[str, float] | None = None
    # The data-parallel rank of the core that sent them (engine/dp_client.py).
    engine_index: int = 0
    # With data parallelism and prefix balancing: the core's KV cache events since its
    # last outputs, which the front end's prefix index follows (engine/dp_balancer.py).
    kv_events: list[KVEvent] | None = None


# An error that starts with this: the request's engine core died while the others go on
# (--data-parallel-tolerate-failure); the server answers 503, as for a dead engine.
ENGINE_CORE_DIED_PREFIX = "engine core died"
