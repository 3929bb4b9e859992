"""Helpers shared by connectors: block tables per KV cache group, layer-to-group maps,
and the worker side's running totals."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from kvserve.protocol.kv_cache_interface import SlidingWindowSpec

if TYPE_CHECKING:
    from kvserve.protocol.kv_cache_interface import KVCacheConfig
    from kvserve.protocol.scheduler_output import SchedulerOutput


class HasBlockIds(Protocol):
    block_ids: list[list[int]]  # one block table per KV cache group


def follow_scheduled_blocks(
    scheduler_output: SchedulerOutput, tracked: Mapping[str, HasBlockIds]
) -> list[tuple[str, int]]:
    """Keeps each tracked request's block tables in step with the scheduler's diffs (new
    tables, appended blocks, tables replaced on resumption) and returns (req_id, tokens
    computed before this step) for every scheduled request.

    Blocks a window freed keep their old id here: connectors only touch blocks whose
    tokens the step still holds (see check_connector_layout)."""
    scheduled: list[tuple[str, int]] = []
    for new in scheduler_output.scheduled_new_reqs:
        if new.req_id in tracked:
            tracked[new.req_id].block_ids = [list(ids) for ids in new.block_ids]
        scheduled.append((new.req_id, new.num_computed_tokens))
    cached = scheduler_output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        entry = tracked.get(req_id)
        new_ids = cached.new_block_ids[i]
        if entry is not None and new_ids is not None:
            if cached.resumed_from_preemption[i]:
                entry.block_ids = [list(ids) for ids in new_ids]
            else:
                for ids, more in zip(entry.block_ids, new_ids, strict=True):
                    ids.extend(more)
        scheduled.append((req_id, cached.num_computed_tokens[i]))
    return scheduled


def layer_to_group(kv_cache_config: KVCacheConfig | None) -> dict[str, int]:
    """Layer name -> its KV cache group (empty without a config: everything is group 0)."""
    if kv_cache_config is None:
        return {}
    return {
        name: group_id
        for group_id, group in enumerate(kv_cache_config.kv_cache_groups)
        for name in group.layer_names
    }


def check_connector_layout(
    kv_cache_config: KVCacheConfig | None, connector: str, min_window: int
) -> list[int]:
    """Refuses KV cache groups a connector cannot serve; returns the sliding windows.

    Full attention and sliding windows wider than min_window tokens are served: a
    window's blocks are freed only once no query sees them, and a connector saving at
    most min_window tokens back from the step's first token still finds them in place.
    Chunked local attention and sinks free blocks by other rules: refused.
    """
    windows: list[int] = []
    if kv_cache_config is None:
        return windows
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if spec.attends_to_all:  # full attention and MLA's latent blocks
            continue
        if type(spec) is SlidingWindowSpec and spec.sliding_window > min_window:
            windows.append(spec.sliding_window)
            continue
        raise ValueError(
            f"{connector} cannot serve the KV cache group {spec.type_id} "
            f"(supported: full attention and sliding windows over {min_window} tokens)"
        )
    return windows


# A worker in the engine core's process (uniproc) leaves its totals (transfer seconds, KV
# that failed authentication) here for the scheduler side's stats, per engine id; workers
# of other processes (mp, TP) keep theirs to themselves.
_WORKER_TOTALS: dict[str, dict[str, dict[str, float]]] = {}
_TOTALS_LOCK = threading.Lock()


def worker_totals(engine_id: str) -> dict[str, dict[str, float]]:
    """A copy of what the engine's worker side counted: {metric: {kind: total}}."""
    with _TOTALS_LOCK:
        return {m: dict(v) for m, v in _WORKER_TOTALS.get(engine_id, {}).items()}


def add_worker_total(engine_id: str, metric: str, kind: str, value: float) -> None:
    with _TOTALS_LOCK:
        totals = _WORKER_TOTALS.setdefault(engine_id, {}).setdefault(metric, {})
        totals[kind] = totals.get(kind, 0.0) + value
