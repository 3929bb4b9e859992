"""The scheduler's side of KV transfer: external prefix hits, async loads, delayed frees,
and what happens when a load fails.

Kept apart from scheduler.py so the core loop stays readable; every method here runs on
the Scheduler (it mixes this class in) and only does something when a connector is set.

Request life with a connector:
  WAITING -(get_num_new_matched_tokens, sync)-> RUNNING with num_computed_tokens = local +
      external hits; the worker loads the external blocks right before the forward.
  WAITING -(load_async)-> WAITING_FOR_REMOTE_KVS holding its blocks; once the worker
      reports it in finished_recving -> WAITING with num_computed_tokens set -> RUNNING.
  finished -(request_finished says delay)-> blocks held until finished_sending.
A load error (invalid_block_ids) rolls the request back to its first bad block
(policy "recompute") or ends it with FINISHED_ERROR (policy "fail").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvserve.core.request import Request, RequestStatus
from kvserve.distributed.kv_transfer.kv_connector.base import KV_LOAD_FAILURE_PREFIX
from kvserve.protocol.kv_connector_output import KVConnectorOutput

if TYPE_CHECKING:
    from kvserve.config import EngineConfig
    from kvserve.core.kv_cache_manager import KVCacheManager
    from kvserve.core.sched.request_queue import RequestQueue
    from kvserve.distributed.kv_transfer.kv_connector.base import KVConnectorBase_V1
    from kvserve.protocol.kv_cache_interface import KVCacheConfig
    from kvserve.protocol.scheduler_output import SchedulerOutput


class SchedulerKVConnectorMixin:
    # Provided by the Scheduler.
    kv_cache_manager: KVCacheManager
    block_size: int
    requests: dict[str, Request]
    running: list[Request]
    waiting: RequestQueue

    if TYPE_CHECKING:

        def _finish_with_error(self, request: Request, message: str) -> None: ...

    def _init_kv_connector(self, config: EngineConfig, kv_cache_config: KVCacheConfig) -> None:
        self.connector: KVConnectorBase_V1 | None = None
        self.kv_load_failure_policy = "recompute"
        transfer = config.kv_transfer_config
        if transfer is not None and transfer.is_kv_transfer_instance:
            # Imported here: a scheduler without a connector never loads the package.
            from kvserve.distributed.kv_transfer.kv_connector.base import KVConnectorRole
            from kvserve.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

            self.connector = KVConnectorFactory.create_connector(
                config, KVConnectorRole.SCHEDULER, kv_cache_config
            )
            self.kv_load_failure_policy = transfer.kv_load_failure_policy
        # WAITING_FOR_REMOTE_KVS request -> num_computed_tokens once its load is done.
        self._async_loads: dict[str, int] = {}
        # Loaded asynchronously, back in WAITING: they hold their blocks already.
        self._async_load_done: set[str] = set()
        # Async loads that hit a load error under policy "fail": ended once finished.
        self._failed_async_loads: set[str] = set()
        # Requests that loaded external KV synchronously in the step now running: their
        # blocks become prefix-cache entries only after the load is known good.
        self._sync_loaded: set[str] = set()
        # Finished requests whose blocks the connector still sends from.
        self._delayed_free: dict[str, Request] = {}

    # ---- schedule() ------------------------------------------------------------------------

    def _match_external(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """External tokens beyond the local hits, and whether they load asynchronously."""
        if self.connector is None or not request.use_prefix_cache_reads:
            return 0, False
        if request.mm_features:
            # External tiers key KV by tokens alone; an image's placeholders are the same
            # tokens for every image, so a multimodal request never loads from them.
            return 0, False
        if request.request_id in self._async_load_done:
            return 0, False  # loaded already (maybe partly, after a load error): compute the rest
        num_external, load_async = self.connector.get_num_new_matched_tokens(
            request, num_computed_tokens
        )
        if num_external is not None and num_computed_tokens + num_external >= request.num_tokens:
            raise RuntimeError(
                f"KV connector offered {num_external} tokens for {request.request_id} beyond "
                f"{num_computed_tokens} computed of {request.num_tokens}: the last token must "
                "be left to compute"
            )
        return num_external, load_async

    def _after_alloc(
        self, request: Request, num_external: int, load_async: bool, num_computed_tokens: int
    ) -> None:
        """Tells the connector where the request's KV goes; parks async loads."""
        if self.connector is None:
            return
        blocks = self.kv_cache_manager.get_blocks(request.request_id)
        self.connector.update_state_after_alloc(request, blocks, num_external)
        request.num_external_computed_tokens = num_external
        if load_async:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self._async_loads[request.request_id] = num_computed_tokens + num_external
        elif num_external > 0:
            self._sync_loaded.add(request.request_id)

    # ---- update_from_output() --------------------------------------------------------------

    def _handle_invalid_blocks(
        self, scheduler_output: SchedulerOutput, invalid_block_ids: set[int]
    ) -> set[str]:
        """Applies kv_load_failure_policy to requests whose blocks failed to load; returns
        the scheduled requests whose results from this step must be dropped."""
        if not invalid_block_ids:
            return set()
        dropped: set[str] = set()
        failed: list[tuple[Request, int]] = []
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is None or request.is_finished():
                continue
            first_bad = self._first_bad_token(request_id, invalid_block_ids)
            if first_bad is None:
                continue
            dropped.add(request_id)
            if self.kv_load_failure_policy == "fail":
                failed.append((request, first_bad))
            else:
                # Recompute from the first bad block; the blocks stay the request's.
                request.num_computed_tokens = min(request.num_computed_tokens, first_bad)
                request.num_cached_tokens = min(request.num_cached_tokens, first_bad)
        for request_id, target in list(self._async_loads.items()):
            first_bad = self._first_bad_token(request_id, invalid_block_ids)
            if first_bad is None:
                continue
            if self.kv_load_failure_policy == "fail":
                self._failed_async_loads.add(request_id)  # ended when its load finishes
            else:
                self._async_loads[request_id] = min(target, first_bad)
        for request, first_bad in failed:
            self.running = [r for r in self.running if r is not request]
            self._finish_with_error(request, self._load_failure_message(request, first_bad))
        return dropped

    def _first_bad_token(self, request_id: str, invalid_block_ids: set[int]) -> int | None:
        """Token index where the request's first invalid block starts, if it has one."""
        first: int | None = None
        for group in self.kv_cache_manager.get_block_ids(request_id):
            for index, block_id in enumerate(group):
                if block_id in invalid_block_ids:
                    if first is None or index < first:
                        first = index
                    break
        return None if first is None else first * self.block_size

    def _load_failure_message(self, request: Request, first_bad: int) -> str:
        return (
            f"{KV_LOAD_FAILURE_PREFIX} for request {request.request_id} "
            f"(tokens from {first_bad} on could not be read) and kv_load_failure_policy "
            "is 'fail'"
        )

    def _cache_sync_loaded(self) -> None:
        """Blocks filled by this step's synchronous loads (known good now) join the cache."""
        for request_id in self._sync_loaded:
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished():
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        self._sync_loaded.clear()

    def _update_from_kv_xfer_finished(self, kv_output: KVConnectorOutput | None) -> None:
        """Finished async loads leave WAITING_FOR_REMOTE_KVS; finished sends free blocks."""
        if kv_output is None:
            kv_output = KVConnectorOutput()
        for request_id in kv_output.finished_recving or ():
            request = self.requests.get(request_id)
            target = self._async_loads.pop(request_id, None)
            if request is None or target is None:
                continue  # finished (aborted) meanwhile; the connector held its blocks
            if request_id in self._failed_async_loads:
                self._failed_async_loads.discard(request_id)
                self.waiting.remove_request(request)
                self._finish_with_error(request, self._load_failure_message(request, target))
                continue
            request.num_computed_tokens = target
            self.kv_cache_manager.cache_blocks(request, target)
            request.status = RequestStatus.WAITING
            self._async_load_done.add(request_id)
        for request_id in kv_output.finished_sending or ():
            request = self._delayed_free.pop(request_id, None)
            if request is not None:
                self.kv_cache_manager.free(request)
        if self.connector is not None:
            self.connector.update_connector_output(kv_output)

    # ---- finishing -------------------------------------------------------------------------

    def _connector_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Asks the connector whether to delay freeing the request's blocks."""
        request_id = request.request_id
        self._async_loads.pop(request_id, None)
        self._failed_async_loads.discard(request_id)
        self._async_load_done.discard(request_id)
        self._sync_loaded.discard(request_id)
        if self.connector is None:
            return False, None
        block_ids = self.kv_cache_manager.get_block_ids(request_id)
        delay, params = self.connector.request_finished(request, block_ids[0] if block_ids else [])
        if delay:
            self._delayed_free[request_id] = request
        return delay, params
