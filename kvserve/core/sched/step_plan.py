"""StepPlan: one step's grants while schedule() builds it.

Owns the step's token and encoder budgets and what each scheduled request got (tokens,
new blocks, drafts, encoder inputs). A running request preempted later in the same step
(its blocks went to an earlier one) hands everything back in one call, ``undo``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.core.sched.utils import make_cached_request_data
from kvserve.protocol.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

if TYPE_CHECKING:
    from kvserve.core.kv_cache_manager import KVCacheBlocks
    from kvserve.core.request import Request


class StepPlan:
    def __init__(self, token_budget: int, encoder_budget: int, max_reqs: int) -> None:
        self.token_budget = token_budget
        self.encoder_budget = encoder_budget
        self.max_reqs = max_reqs
        self.num_scheduled_tokens: dict[str, int] = {}
        self.new_blocks: dict[str, KVCacheBlocks] = {}
        # Requests the workers hold already (blocks appended), new ones and ones resumed
        # from preemption (they send their whole block table).
        self.running: list[Request] = []
        self.new: list[Request] = []
        self.resumed: list[Request] = []
        self.preempted: list[Request] = []
        self.spec_tokens: dict[str, list[int]] = {}
        self.encoder_inputs: dict[str, list[int]] = {}

    def has_room(self) -> bool:
        return self.token_budget > 0 and len(self.num_scheduled_tokens) < self.max_reqs

    def grant(
        self,
        request: Request,
        num_tokens: int,
        new_blocks: KVCacheBlocks,
        spec_tokens: list[int],
        encoder_inputs: list[int],
        encoder_budget: int,
    ) -> None:
        """``encoder_budget`` is what is left after this request's encoder inputs."""
        request_id = request.request_id
        self.num_scheduled_tokens[request_id] = num_tokens
        self.new_blocks[request_id] = new_blocks
        self.token_budget -= num_tokens
        if spec_tokens:
            self.spec_tokens[request_id] = spec_tokens
        if encoder_inputs:
            self.encoder_inputs[request_id] = encoder_inputs
            self.encoder_budget = encoder_budget

    def undo(self, request: Request) -> bool:
        """Hands back what a running request was granted in this step (it is being
        preempted); returns whether it had been granted anything. Its encoder budget stays
        spent: the encoder cache entries it reserved are freed with the request."""
        for granted in (self.running, self.new, self.resumed):
            if request in granted:
                granted.remove(request)
        request_id = request.request_id
        num_tokens = self.num_scheduled_tokens.pop(request_id, None)
        if num_tokens is None:
            return False
        self.token_budget += num_tokens
        del self.new_blocks[request_id]
        self.spec_tokens.pop(request_id, None)
        self.encoder_inputs.pop(request_id, None)
        return True

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    def to_output(
        self,
        finished_req_ids: set[str],
        num_common_prefix_blocks: tuple[int, ...],
        free_encoder_mm_hashes: list[str],
        send_new_token_ids: bool,
    ) -> SchedulerOutput:
        """The step for the workers; call it before the requests' num_computed_tokens
        advance (new and cached requests carry their state at the step's start)."""
        new_reqs_data = [
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                sampling_params=r.sampling_params,
                block_ids=self.new_blocks[r.request_id].get_block_ids(),
                num_computed_tokens=r.num_computed_tokens,
                output_token_ids=list(r.output_token_ids),
                pooling_params=r.pooling_params,
                lora_request=r.lora_request,
                mm_features=r.mm_features,
            )
            for r in self.new
        ]
        cached_reqs_data = make_cached_request_data(
            self.running,
            self.resumed,
            self.new_blocks,
            self.num_scheduled_tokens if send_new_token_ids else None,
        )
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached_reqs_data,
            num_scheduled_tokens=self.num_scheduled_tokens,
            total_num_scheduled_tokens=self.total_num_scheduled_tokens,
            num_common_prefix_blocks=num_common_prefix_blocks,
            finished_req_ids=finished_req_ids,
            preempted_req_ids={r.request_id for r in self.preempted},
            scheduled_spec_decode_tokens=self.spec_tokens,
            scheduled_encoder_inputs=self.encoder_inputs,
            free_encoder_mm_hashes=free_encoder_mm_hashes,
        )


def empty_step_output(finished_req_ids: set[str], preempted_req_ids: set[str]) -> SchedulerOutput:
    """A step that runs nothing but tells the workers what finished or was preempted."""
    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
        finished_req_ids=finished_req_ids,
        preempted_req_ids=preempted_req_ids,
    )
