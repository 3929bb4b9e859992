"""The worker's request-state table: the one writer of every request's output tokens.

A request's output token list is read in three places (its CachedRequestState, the
SamplingBatch's penalties, the logits processors) as one shared list object, and
mirrored in the persistent batch's token rows (``token_ids_cpu``, ``num_tokens``). Every
change to it goes through this table, which updates the list and its mirrors together.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import numpy as np
import torch

from kvserve.protocol.scheduler_output import NewRequestData
from kvserve.sampling_params import SamplingType
from kvserve.worker.input_batch import InputBatch
from kvserve.worker.request_state import CachedRequestState


class KeepsRequestState(Protocol):
    """A runner component with per-request state: it forgets finished requests here."""

    def remove_requests(self, req_ids: set[str]) -> None: ...

    def request_census(self) -> dict[str, int]: ...


class RequestStates:
    """req_id -> CachedRequestState, kept while a request is preempted too."""

    def __init__(self, device: torch.device, eos_token_id: int | None) -> None:
        self.device = device
        self.eos_token_id = eos_token_id
        self._states: dict[str, CachedRequestState] = {}
        self._batch: InputBatch | None = None

    def bind_batch(self, batch: InputBatch) -> None:
        """The persistent batch whose token rows mirror the states' tokens."""
        self._batch = batch

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._states

    def __getitem__(self, req_id: str) -> CachedRequestState:
        return self._states[req_id]

    def __len__(self) -> int:
        return len(self._states)

    def add(self, new: NewRequestData) -> CachedRequestState:
        """The state of a newly scheduled request (a re-sent one replaces the old)."""
        params = new.sampling_params
        generator = None
        if params.sampling_type == SamplingType.RANDOM_SEED and params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        state = CachedRequestState(
            req_id=new.req_id,
            prompt_token_ids=list(new.prompt_token_ids),
            sampling_params=params,
            generator=generator,
            block_ids=tuple(list(ids) for ids in new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            output_token_ids=list(new.output_token_ids),
            eos_token_id=self.eos_token_id,
            pooling_params=new.pooling_params,
            lora_request=new.lora_request,
            mm_features=list(new.mm_features),
        )
        self._states[new.req_id] = state
        return state

    def request_census(self) -> dict[str, int]:
        return {"states": len(self._states)}

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        batch = self._bound()
        for req_id in req_ids:
            self._states.pop(req_id, None)
            batch.remove_request(req_id)

    def _bound(self) -> InputBatch:
        if self._batch is None:
            raise RuntimeError("initialize_kv_cache() must run before execute_model()")
        return self._batch

    # ---- the writer of output tokens -------------------------------------------------------

    def append_sampled(
        self, rows: np.ndarray, token_ids: np.ndarray, by_row: list[list[int]]
    ) -> None:
        """One sampled token per batch row of ``rows``; ``by_row[row]`` (the step's output,
        one list per batch row) gets it in the same pass."""
        batch = self._bound()
        batch.append_token_ids(rows, token_ids)
        requests = batch.requests
        for row, token in zip(rows.tolist(), token_ids.tolist(), strict=True):
            request = requests[row]
            assert request is not None
            request.output_token_ids.append(token)
            by_row[row] = [token]

    def append_sampled_lists(
        self, rows: np.ndarray, sampled: list[list[int]], by_row: list[list[int]]
    ) -> None:
        """Several tokens per batch row (drafts verified by the rejection sampler)."""
        batch = self._bound()
        for row, tokens in zip(rows.tolist(), sampled, strict=True):
            batch.extend_token_ids(row, tokens)
            request = batch.requests[row]
            assert request is not None
            request.output_token_ids.extend(tokens)
            by_row[row] = tokens

    def take_new_token_ids(self, state: CachedRequestState, token_ids: list[int]) -> None:
        """An earlier pipeline stage: appends the tokens the last stage sampled, which end
        the step's scheduled tokens (vLLM's rule)."""
        num_new = state.num_computed_tokens + len(token_ids) - state.num_tokens
        if num_new <= 0:
            return
        new = token_ids[-num_new:]
        state.output_token_ids.extend(new)
        batch = self._bound()
        row = batch.req_id_to_index.get(state.req_id)
        if row is not None:
            batch.extend_token_ids(row, new)

    def truncate(self, state: CachedRequestState, num_output_tokens: int) -> bool:
        """Drops output tokens past ``num_output_tokens`` (the scheduler dropped a token
        sampled over KV whose load failed); the request leaves the batch so its row is
        rebuilt from the state. Returns whether anything was dropped."""
        if len(state.output_token_ids) <= num_output_tokens:
            return False
        # del, not a new list: the SamplingBatch holds the same list object.
        del state.output_token_ids[num_output_tokens:]
        self._bound().remove_request(state.req_id)
        return True
