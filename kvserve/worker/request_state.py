"""What the worker remembers about one request between steps."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.lora.request import LoRARequest
from kvserve.pooling_params import PoolingParams
from kvserve.protocol.mm_inputs import MultiModalFeatureSpec
from kvserve.sampling_params import SamplingParams
from kvserve.utils.census import per_request


@per_request
@dataclass
class CachedRequestState:
    """Worker-side state of a request, kept while it is preempted too.

    ``output_token_ids`` is a live list: the runner appends each sampled token and the
    SamplingBatch reads the same list object (for penalties), so it is never replaced.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: tuple[list[int], ...]  # one list per KV cache group
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_id: int | None = None
    # Set once the last prompt chunk has produced its prompt logprobs, so a recompute
    # after preemption does not emit them a second time.
    prompt_logprobs_done: bool = False
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None
    # Its images (with their pixel values), for the encoder runner.
    mm_features: list[MultiModalFeatureSpec] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_logprobs(self) -> int | None:
        """How many prompt logprobs are still owed (None when not asked or done)."""
        if self.prompt_logprobs_done:
            return None
        return self.sampling_params.prompt_logprobs
