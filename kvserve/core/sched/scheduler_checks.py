"""What the scheduler reports and checks about itself, and the roll-back of a failed step.

Apart from scheduler.py: they read every collaborator, and only the stats run in a
normal step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.core.block_pool import require_integrity
from kvserve.core.request import RequestStatus
from kvserve.protocol.engine_core import EngineCoreOutput, FinishReason, SchedulerStats

if TYPE_CHECKING:
    from kvserve.core.kv_cache_manager import KVCacheManager
    from kvserve.core.request import Request
    from kvserve.core.sched.request_table import RequestTable
    from kvserve.core.sched.scheduler import Scheduler
    from kvserve.protocol.scheduler_output import SchedulerOutput


def undo_partial_update(
    table: RequestTable, scheduler_output: SchedulerOutput, block_size: int, message: str
) -> None:
    """update_from_output raised outside any one request: tokens it appended were never
    reported, so they are dropped (the rerun samples them again). A request it finished
    has lost its final output: that request ends with the error instead, so that its
    caller does not wait forever (one aborted meanwhile is ignored by the front end)."""
    cached = scheduler_output.scheduled_cached_reqs
    num_output = dict(zip(cached.req_ids, cached.num_output_tokens, strict=True))
    for new in scheduler_output.scheduled_new_reqs:
        num_output[new.req_id] = len(new.output_token_ids)
    lost = []
    for request_id in scheduler_output.num_scheduled_tokens:
        request = table.get(request_id)
        if request is None or request.is_finished():
            if request is not None:
                lost.append(request)
            table.add_pending_output(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=[],
                    finish_reason=FinishReason.ERROR,
                    error=message,
                )
            )
        elif request_id in num_output:
            request.truncate_output_token_ids(num_output[request_id], block_size)
    table.remove(lost)


def check_scheduler_integrity(scheduler: Scheduler) -> None:
    """Raises AssertionError if the queues, requests and KV cache disagree.

    Call it between steps (after update_from_output): every live request is in exactly
    one of running/waiting, only running requests (and those a KV connector still loads
    into or sends from) hold blocks, and each running request's blocks hold its computed
    tokens. Then the KV cache manager checks its tables against the pool.
    """
    table = scheduler.table
    running_ids = [r.request_id for r in table.running]
    waiting_ids = [r.request_id for r in table.waiting]
    require_integrity(len(set(running_ids)) == len(running_ids), "a request runs twice")
    require_integrity(len(set(waiting_ids)) == len(waiting_ids), "a request waits twice")
    require_integrity(
        sorted(running_ids + waiting_ids) == sorted(table.requests),
        "requests != running + waiting",
    )
    require_integrity(len(running_ids) <= scheduler.max_num_running_reqs, "too many running")
    for request in table.running:
        require_integrity(request.status == RequestStatus.RUNNING, f"{request} in running")
    for request in table.waiting:
        require_integrity(
            request.status != RequestStatus.RUNNING and not request.is_finished(),
            f"{request} in waiting",
        )
    may_hold = {*running_ids, *scheduler.kv_transfer.may_hold_blocks()}
    manager = scheduler.kv_cache_manager
    for group_blocks in (m.req_to_blocks for m in manager.coordinator.single_type_managers):
        holders = {rid for rid, blocks in group_blocks.items() if blocks}
        require_integrity(holders <= may_hold, f"{holders - may_hold} hold blocks idly")
    slot_groups = [
        i for i, m in enumerate(manager.coordinator.single_type_managers) if m.tracks_token_slots
    ]
    for request in table.running:
        if not slot_groups:
            break  # only Mamba groups: a state block per request, checked by its manager
        block_ids = manager.get_block_ids(request.request_id)[slot_groups[0]]
        num_slots = len(block_ids) * scheduler.block_size
        require_integrity(
            request.num_computed_tokens <= min(num_slots, request.num_tokens),
            f"{request} computed {request.num_computed_tokens} tokens in {num_slots} slots",
        )
    scheduler.isolator.check_integrity(table.requests, running_ids)
    manager.check_integrity()
    scheduler.encoder.check_integrity()


def evict_step_blocks(
    manager: KVCacheManager, scheduler_output: SchedulerOutput, failed: list[Request]
) -> None:
    """From the block holding a failed step's first token on, a block's KV may be half
    written (allocate_slots cached it ahead of the forward): nobody may hit it later."""
    block_size = manager.block_size
    for request in failed:
        start = (
            request.num_computed_tokens - scheduler_output.num_scheduled_tokens[request.request_id]
        )
        for block_ids in manager.get_block_ids(request.request_id):
            manager.block_pool.evict_blocks(block_ids[start // block_size :])


def make_scheduler_stats(scheduler: Scheduler) -> SchedulerStats:
    table, manager = scheduler.table, scheduler.kv_cache_manager
    prefix = manager.make_prefix_cache_stats()
    return SchedulerStats(
        num_running_reqs=len(table.running),
        num_waiting_reqs=len(table.waiting),
        kv_cache_usage=manager.usage,
        kv_cache_blocks_in_use=manager.num_blocks_in_use,
        prefix_cache_queries=prefix.queries if prefix else 0,
        prefix_cache_hits=prefix.hits if prefix else 0,
        num_preemptions=table.num_preemptions,
        kv_connector_stats=scheduler.kv_transfer.make_stats(),
        spec_decoding_stats=scheduler.spec_decode.make_stats(),
        mm_stats=scheduler.encoder.make_stats(),
    )
