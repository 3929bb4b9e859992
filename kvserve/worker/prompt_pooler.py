"""The worker side of pooling requests: fold each prompt's hidden states, chunk by
chunk, and hand back the vector once the prompt is complete."""

from __future__ import annotations

import torch

from kvserve.model_executor.layers.pooler import Pooler
from kvserve.pooling_params import PoolerConfig
from kvserve.worker.input_batch import InputBatch
from kvserve.worker.input_preparation import StepInputs


class PromptPooler:
    def __init__(self, config: PoolerConfig) -> None:
        self.pooler = Pooler(config)
        # req_id -> the pooling method's state after the chunks computed so far.
        self._states: dict[str, torch.Tensor] = {}

    def remove_requests(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self._states.pop(req_id, None)

    def pending_req_ids(self) -> set[str]:
        """Requests with a partly folded prompt."""
        return set(self._states)

    def pool_step(
        self, hidden_states: torch.Tensor, batch: InputBatch, inputs: StepInputs
    ) -> dict[str, list[float]]:
        """Folds this step's chunk of every row; returns the vectors of the prompts that
        end in this step (their state is dropped). A chunk at position 0 starts afresh,
        so a request recomputed after preemption pools only its new pass."""
        finished: dict[str, list[float]] = {}
        for row, request in enumerate(batch.requests):
            if request is None:
                continue
            num_scheduled = int(inputs.num_scheduled_tokens[row])
            if num_scheduled == 0:
                continue
            start = int(batch.num_computed_tokens_cpu[row])
            offset = int(inputs.query_start_loc_np[row])
            num_prompt = request.num_prompt_tokens
            # Only prompt positions count: a pooling request never has output tokens.
            end = min(start + num_scheduled, num_prompt)
            chunk = hidden_states[offset : offset + end - start]
            state = self.pooler.fold(self._states.get(request.req_id), chunk, start)
            if end >= num_prompt:
                self._states.pop(request.req_id, None)
                finished[request.req_id] = self.pooler.finish(
                    state, num_prompt, request.pooling_params
                )
            else:
                self._states[request.req_id] = state
        return finished
