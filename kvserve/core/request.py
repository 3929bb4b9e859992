"""The scheduler's view of one request: its tokens, progress and status."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import Any

from kvserve.lora.request import LoRARequest
from kvserve.pooling_params import PoolingParams
from kvserve.protocol.engine_core import EngineCoreRequest, FinishReason
from kvserve.protocol.mm_inputs import MultiModalFeatureSpec
from kvserve.sampling_params import SamplingParams
from kvserve.structured_output.request import StructuredOutputRequest
from kvserve.utils.census import per_request


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    # Its grammar compiles (StructuredOutputManager); other requests run meanwhile.
    WAITING_FOR_FSM = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is a finished state.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}

# Computes the hashes of the request's full blocks that are not hashed yet.
BlockHasher = Callable[["Request"], list[Any]]


@per_request
class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        block_hasher: BlockHasher | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
        mm_features: list[MultiModalFeatureSpec] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.priority = priority
        self.cache_salt = cache_salt
        self.kv_transfer_params = kv_transfer_params
        self.pooling_params = pooling_params
        # Set before the block hasher runs: the adapter id is part of every block hash.
        self.lora_request = lora_request
        # Likewise the multimodal items: their hashes key the blocks they fall in.
        self.mm_features: list[MultiModalFeatureSpec] = mm_features or []

        self.status = RequestStatus.WAITING
        self.structured_output_request: StructuredOutputRequest | None = None
        if sampling_params.structured_outputs is not None:
            self.structured_output_request = StructuredOutputRequest(
                sampling_params.structured_outputs, prompt_token_ids
            )
            self.status = RequestStatus.WAITING_FOR_FSM
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.max_tokens = sampling_params.max_tokens
        self.num_prompt_tokens = len(prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Async scheduling: tokens sampled by steps in flight, not yet appended; the
        # scheduler computes past them (their KV) before it knows them (in_flight.py).
        self.num_output_placeholders = 0
        # Prefix-cache hits at first scheduling; -1 until then.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Tokens computed by an external KV store (connectors), set at scheduling.
        self.num_external_computed_tokens = 0
        # Draft tokens proposed for the next step (speculative decoding): computed along
        # with the request's tokens, never part of them until the rejection sampler keeps them.
        self.spec_token_ids: list[int] = []

        # False once a KV connector said it fills this request's KV approximately
        # (CacheBlend): its blocks then never become prefix-cache entries.
        self.writes_prefix_cache = True
        self.block_hashes: list[Any] = []
        self._block_hasher = block_hasher
        self.update_block_hashes()

    @classmethod
    def from_engine_core_request(
        cls, request: EngineCoreRequest, block_hasher: BlockHasher | None
    ) -> Request:
        return cls(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time,
            priority=request.priority,
            cache_salt=request.cache_salt,
            block_hasher=block_hasher,
            kv_transfer_params=request.kv_transfer_params,
            pooling_params=request.pooling_params,
            lora_request=request.lora_request,
            mm_features=request.mm_features,
        )

    def update_block_hashes(self) -> None:
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        self.update_block_hashes()

    def truncate_output_token_ids(self, num_output_tokens: int, block_size: int) -> None:
        """Forgets the output tokens past the first num_output_tokens (a step that appended
        them failed before reporting them), and the hashes of blocks no longer full."""
        dropped = self.num_output_tokens - num_output_tokens
        if dropped <= 0:
            return
        so_request = self.structured_output_request
        grammar = so_request.grammar if so_request is not None else None
        if grammar is not None:
            # The matcher took those tokens too (but reasoning tokens, which it never
            # saw); the rerun feeds it their replacements.
            gate = so_request.reasoning_gate if so_request is not None else None
            taken = (
                dropped
                if gate is None
                else gate.truncate(self.num_output_tokens, num_output_tokens)
            )
            if taken:
                grammar.rollback(taken)
        del self._output_token_ids[num_output_tokens:]
        del self._all_token_ids[len(self._all_token_ids) - dropped :]
        del self.block_hashes[self.num_tokens // block_size :]

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    @property
    def use_prefix_cache_reads(self) -> bool:
        # Prompt logprobs need the logits of every prompt position, so they must be computed.
        return self.sampling_params.prompt_logprobs is None

    def __lt__(self, other: Request) -> bool:
        # Priority queue order: lower priority value first, then earlier arrival.
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
