"""Helpers shared by connectors on the scheduler side."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvserve.protocol.scheduler_output import SchedulerOutput


class HasBlockIds(Protocol):
    block_ids: list[int]


def follow_scheduled_blocks(
    scheduler_output: SchedulerOutput, tracked: Mapping[str, HasBlockIds]
) -> list[tuple[str, int]]:
    """Keeps each tracked request's block table in step with the scheduler's diffs (new
    tables, appended blocks, tables replaced on resumption) and returns (req_id, tokens
    computed before this step) for every scheduled request."""
    scheduled: list[tuple[str, int]] = []
    for new in scheduler_output.scheduled_new_reqs:
        if new.req_id in tracked:
            tracked[new.req_id].block_ids = list(new.block_ids[0])
        scheduled.append((new.req_id, new.num_computed_tokens))
    cached = scheduler_output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        entry = tracked.get(req_id)
        new_ids = cached.new_block_ids[i]
        if entry is not None and new_ids is not None:
            if cached.resumed_from_preemption[i]:
                entry.block_ids = list(new_ids[0])
            else:
                entry.block_ids.extend(new_ids[0])
        scheduled.append((req_id, cached.num_computed_tokens[i]))
    return scheduled
