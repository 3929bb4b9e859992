"""What the scheduler tells the workers each step: new requests in full, the rest as diffs."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvserve.lora.request import LoRARequest
from kvserve.pooling_params import PoolingParams
from kvserve.protocol.mm_inputs import MultiModalFeatureSpec
from kvserve.sampling_params import SamplingParams


class KVConnectorMetadata:
    """What a KV connector's scheduler side tells its worker side for one step; each
    connector subclasses it as a dataclass of plain fields, so it crosses processes as
    msgpack (the executor's wire format names the subclass and sends its fields)."""


@dataclass
class NewRequestData:
    """A request the workers have not seen yet (or must forget and rebuild)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]  # one list per KV cache group
    num_computed_tokens: int
    # Output tokens a worker must know of, e.g. for a request forked from another.
    output_token_ids: list[int] = field(default_factory=list)
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None
    mm_features: list[MultiModalFeatureSpec] = field(default_factory=list)


@dataclass
class CachedRequestData:
    """Diffs for requests the workers already hold, as parallel lists."""

    req_ids: list[str] = field(default_factory=list)
    # True where the request was preempted and now resumes: its block ids are replaced.
    resumed_from_preemption: list[bool] = field(default_factory=list)
    # Blocks appended since the last step (or the whole table when resumed); None = none new.
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)
    # Pipeline parallelism only (else empty): the tokens each request computes this step.
    # Only the last stage samples, so the others learn the sampled tokens from here.
    new_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens computed for it in this step.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Blocks every running request shares at the start of its table (cascade attention).
    num_common_prefix_blocks: tuple[int, ...] = ()
    # Finished since the last step: workers drop their state for these.
    finished_req_ids: set[str] = field(default_factory=set)
    # Preempted in this step: workers drop them from the batch, keep their state.
    preempted_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: KVConnectorMetadata | None = None
    # req_id -> the draft tokens computed for it in this step (speculative decoding); they
    # are the last len(...) of its num_scheduled_tokens. Absent: no drafts.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> indices of its mm_features whose encoder runs in this step.
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    # Encoder outputs the scheduler's encoder cache evicted: workers drop them.
    free_encoder_mm_hashes: list[str] = field(default_factory=list)

    @classmethod
    def empty(cls) -> SchedulerOutput:
        return cls([], CachedRequestData(), {}, 0)


@dataclass
class GrammarOutput:
    """The step's token bitmask for its constrained requests (vLLM's GrammarOutput).

    Row i of ``grammar_bitmask`` (int32, ceil(V/32) words, bit set = allowed) belongs to
    ``structured_output_request_ids[i]``; only requests that sample this step are listed.
    """

    structured_output_request_ids: list[str]
    grammar_bitmask: np.ndarray
