"""What the scheduler reports about itself: per-step stats and its integrity check."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.core.block_pool import require_integrity
from kvserve.core.request import Request, RequestStatus
from kvserve.protocol.engine_core import SchedulerStats

if TYPE_CHECKING:
    from kvserve.core.encoder_cache_manager import EncoderCacheManager
    from kvserve.core.kv_cache_manager import KVCacheManager
    from kvserve.core.sched.request_queue import RequestQueue
    from kvserve.distributed.kv_transfer.kv_connector.base import KVConnectorBase_V1
    from kvserve.protocol.engine_core import MultiModalStats, SpecDecodingStats


class SchedulerStatsMixin:
    # Provided by the Scheduler and its other mixins.
    log_stats: bool
    kv_cache_manager: KVCacheManager
    encoder_cache_manager: EncoderCacheManager | None
    connector: KVConnectorBase_V1 | None
    requests: dict[str, Request]
    running: list[Request]
    waiting: RequestQueue
    max_num_running_reqs: int
    block_size: int
    num_preemptions: int
    _async_loads: dict[str, int]
    _async_load_done: set[str]
    _delayed_free: dict[str, Request]

    if TYPE_CHECKING:

        def _spec_decoding_stats_snapshot(self) -> SpecDecodingStats | None: ...
        def _mm_stats_snapshot(self) -> MultiModalStats | None: ...
        def _check_isolation_integrity(self) -> None: ...

    def make_stats(self) -> SchedulerStats | None:
        if not self.log_stats:
            return None
        prefix = self.kv_cache_manager.make_prefix_cache_stats()
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            kv_cache_blocks_in_use=self.kv_cache_manager.num_blocks_in_use,
            prefix_cache_queries=prefix.queries if prefix else 0,
            prefix_cache_hits=prefix.hits if prefix else 0,
            num_preemptions=self.num_preemptions,
            kv_connector_stats=self.connector.get_kv_connector_stats() if self.connector else None,
            spec_decoding_stats=self._spec_decoding_stats_snapshot(),
            mm_stats=self._mm_stats_snapshot(),
        )

    def check_integrity(self) -> None:
        """Raises AssertionError if the queues, requests and KV cache disagree (tests, debug).

        Call it between steps (after update_from_output): every live request is in exactly
        one of running/waiting, only running requests (and those a KV connector still loads
        into or sends from) hold blocks, and each running request's blocks hold its
        computed tokens. Then the KV cache manager checks its tables against the pool.
        """
        running_ids = [r.request_id for r in self.running]
        waiting_ids = [r.request_id for r in self.waiting]
        require_integrity(len(set(running_ids)) == len(running_ids), "a request runs twice")
        require_integrity(len(set(waiting_ids)) == len(waiting_ids), "a request waits twice")
        require_integrity(
            sorted(running_ids + waiting_ids) == sorted(self.requests),
            "requests != running + waiting",
        )
        require_integrity(len(self.running) <= self.max_num_running_reqs, "too many running")
        for request in self.running:
            require_integrity(request.status == RequestStatus.RUNNING, f"{request} in running")
        for request in self.waiting:
            require_integrity(
                request.status != RequestStatus.RUNNING and not request.is_finished(),
                f"{request} in waiting",
            )
        may_hold = {*running_ids, *self._async_loads, *self._async_load_done, *self._delayed_free}
        manager = self.kv_cache_manager
        for group_blocks in (m.req_to_blocks for m in manager.coordinator.single_type_managers):
            holders = {rid for rid, blocks in group_blocks.items() if blocks}
            require_integrity(holders <= may_hold, f"{holders - may_hold} hold blocks idly")
        for request in self.running:
            num_slots = len(manager.get_block_ids(request.request_id)[0]) * self.block_size
            require_integrity(
                request.num_computed_tokens <= min(num_slots, request.num_tokens),
                f"{request} computed {request.num_computed_tokens} tokens in {num_slots} slots",
            )
        self._check_isolation_integrity()
        manager.check_integrity()
        if self.encoder_cache_manager is not None:
            self.encoder_cache_manager.check_integrity()
