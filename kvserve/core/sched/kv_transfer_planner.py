"""The scheduler's side of KV transfer: external prefix hits, async loads, delayed frees,
and what happens when a load fails.

Request life with a connector:
  WAITING -(get_num_new_matched_tokens, sync)-> RUNNING with num_computed_tokens = local +
      external hits; the worker loads the external blocks right before the forward.
  WAITING -(load_async)-> WAITING_FOR_REMOTE_KVS holding its blocks; once the worker
      reports it in finished_recving -> WAITING with num_computed_tokens set -> RUNNING.
  finished -(request_finished says delay)-> blocks held until finished_sending.
A load error (invalid_block_ids) rolls the request back to its first bad block
(policy "recompute") or ends it with FINISHED_ERROR (policy "fail").

``NoKVTransfer`` is the planner of an engine without a connector: every request is a
plain local one, and the scheduler calls it without asking whether a connector exists.
The planner owns the connector's five request sets; it never ends a request itself but
returns the ones to end, with their message, to the scheduler.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvserve.core.request import Request, RequestStatus
from kvserve.distributed.kv_transfer.kv_connector.base import KV_LOAD_FAILURE_PREFIX
from kvserve.protocol.kv_connector_output import KVConnectorOutput

if TYPE_CHECKING:
    from kvserve.config import EngineConfig
    from kvserve.core.kv_cache_manager import KVCacheManager
    from kvserve.distributed.kv_transfer.kv_connector.base import KVConnectorBase_V1
    from kvserve.protocol.kv_cache_interface import KVCacheConfig
    from kvserve.protocol.scheduler_output import KVConnectorMetadata, SchedulerOutput

# A request to end with an error, and the error.
Failure = tuple[Request, str]
Requests = Mapping[str, Request]


class NoKVTransfer:
    """No connector: nothing is matched, loaded, held or sent."""

    connector: KVConnectorBase_V1 | None = None

    def match_external(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def is_load_done(self, request_id: str) -> bool:
        return False

    def after_alloc(
        self, request: Request, num_external: int, load_async: bool, num_computed_tokens: int
    ) -> None:
        pass

    def build_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata | None:
        return None

    def update_from_output(
        self, step: SchedulerOutput, kv_output: KVConnectorOutput | None, requests: Requests
    ) -> tuple[set[str], list[Failure]]:
        """The worker side's report on a step: returns the scheduled requests whose results
        from the step must be dropped, and the requests to end with an error."""
        return set(), []

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def may_hold_blocks(self) -> set[str]:
        return set()

    def request_census(self) -> dict[str, int]:
        return {}

    def has_delayed_frees(self) -> bool:
        return False

    def make_stats(self) -> dict[str, dict[str, float]] | None:
        return None

    def shutdown(self) -> None:
        pass


class KVTransferPlanner(NoKVTransfer):
    def __init__(
        self,
        connector: KVConnectorBase_V1,
        kv_cache_manager: KVCacheManager,
        block_size: int,
        kv_load_failure_policy: str,
    ) -> None:
        self.connector = connector
        self._connector = connector  # typed without None, for the methods here
        self.kv_cache_manager = kv_cache_manager
        self.block_size = block_size
        self.kv_load_failure_policy = kv_load_failure_policy
        # WAITING_FOR_REMOTE_KVS request -> num_computed_tokens once its load is done.
        self.async_loads: dict[str, tuple[Request, int]] = {}
        # Loaded asynchronously, back in WAITING: they hold their blocks already.
        self.async_load_done: set[str] = set()
        # Async loads that hit a load error under policy "fail": ended once finished.
        self.failed_async_loads: set[str] = set()
        # Requests that loaded external KV synchronously in the step now running: their
        # blocks become prefix-cache entries only after the load is known good.
        self.sync_loaded: dict[str, Request] = {}
        # Finished requests whose blocks the connector still sends from.
        self.delayed_free: dict[str, Request] = {}

    @classmethod
    def create(
        cls, config: EngineConfig, kv_cache_config: KVCacheConfig, kv_cache_manager: KVCacheManager
    ) -> NoKVTransfer:
        """The planner for ``config``: a connector's, or the no-op one without transfer."""
        transfer = config.kv_transfer_config
        if transfer is None or not transfer.is_kv_transfer_instance:
            return NoKVTransfer()
        # Imported here: a scheduler without a connector never loads the package.
        from kvserve.distributed.kv_transfer.kv_connector.base import KVConnectorRole
        from kvserve.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        connector = KVConnectorFactory.create_connector(
            config, KVConnectorRole.SCHEDULER, kv_cache_config
        )
        return cls(
            connector,
            kv_cache_manager,
            config.cache_config.block_size,
            transfer.kv_load_failure_policy,
        )

    # ---- schedule() ------------------------------------------------------------------------

    def match_external(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """External tokens beyond the local hits, and whether they load asynchronously
        (None: the connector decides in a later step)."""
        request.writes_prefix_cache = self._connector.computes_exact_kv(request)
        if not request.use_prefix_cache_reads:
            return 0, False
        if request.mm_features:
            # External tiers key KV by tokens alone; an image's placeholders are the same
            # tokens for every image, so a multimodal request never loads from them.
            return 0, False
        if request.request_id in self.async_load_done:
            return 0, False  # loaded already (maybe partly, after a load error): compute the rest
        num_external, load_async = self._connector.get_num_new_matched_tokens(
            request, num_computed_tokens
        )
        if num_external is not None and num_computed_tokens + num_external >= request.num_tokens:
            raise RuntimeError(
                f"KV connector offered {num_external} tokens for {request.request_id} beyond "
                f"{num_computed_tokens} computed of {request.num_tokens}: the last token must "
                "be left to compute"
            )
        return num_external, load_async

    def is_load_done(self, request_id: str) -> bool:
        """Whether the request's async load finished: it holds its blocks, no lookup again."""
        return request_id in self.async_load_done

    def after_alloc(
        self, request: Request, num_external: int, load_async: bool, num_computed_tokens: int
    ) -> None:
        """Tells the connector where the request's KV goes; parks async loads."""
        request_id = request.request_id
        self.async_load_done.discard(request_id)
        blocks = self.kv_cache_manager.get_blocks(request_id)
        self._connector.update_state_after_alloc(request, blocks, num_external)
        request.num_external_computed_tokens = num_external
        if load_async:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self.async_loads[request_id] = (request, num_computed_tokens + num_external)
        elif num_external > 0:
            self.sync_loaded[request_id] = request

    def build_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata | None:
        # Before num_computed_tokens advances: the connector plans from the step's start.
        return self._connector.build_connector_meta(scheduler_output)

    # ---- update_from_output() --------------------------------------------------------------

    def update_from_output(
        self, step: SchedulerOutput, kv_output: KVConnectorOutput | None, requests: Requests
    ) -> tuple[set[str], list[Failure]]:
        if kv_output is None:
            kv_output = KVConnectorOutput()
        dropped, failed = self._handle_invalid_blocks(step, kv_output, requests)
        return dropped, failed + self._update_transfers(kv_output)

    def _handle_invalid_blocks(
        self, step: SchedulerOutput, kv_output: KVConnectorOutput, requests: Requests
    ) -> tuple[set[str], list[Failure]]:
        """Applies kv_load_failure_policy to requests whose blocks failed to load; returns
        the scheduled requests whose results from this step must be dropped, and (policy
        "fail") the running requests to end."""
        invalid = kv_output.invalid_block_ids
        if not invalid:
            return set(), []
        dropped: set[str] = set()
        failed: list[Failure] = []
        for request_id in step.num_scheduled_tokens:
            request = requests.get(request_id)
            if request is None or request.is_finished():
                continue
            first_bad = self._first_bad_token(request_id, invalid)
            if first_bad is None:
                continue
            dropped.add(request_id)
            if self.kv_load_failure_policy == "fail":
                failed.append((request, self._load_failure_message(request, first_bad)))
            else:
                # Recompute from the first bad block; the blocks stay the request's.
                request.num_computed_tokens = min(request.num_computed_tokens, first_bad)
                request.num_cached_tokens = min(request.num_cached_tokens, first_bad)
        for request_id, (request, target) in list(self.async_loads.items()):
            first_bad = self._first_bad_token(request_id, invalid)
            if first_bad is None:
                continue
            if self.kv_load_failure_policy == "fail":
                self.failed_async_loads.add(request_id)  # ended when its load finishes
            else:
                self.async_loads[request_id] = (request, min(target, first_bad))
        return dropped, failed

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

    def _update_transfers(self, kv_output: KVConnectorOutput) -> list[Failure]:
        """After the step: blocks of synchronous loads (known good now) join the prefix
        cache; finished async loads leave WAITING_FOR_REMOTE_KVS (or, failed under policy
        "fail", are returned to end); finished sends free their blocks."""
        for request in self.sync_loaded.values():
            if not request.is_finished():
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        self.sync_loaded.clear()
        failed: list[Failure] = []
        for request_id in kv_output.finished_recving or ():
            parked = self.async_loads.pop(request_id, None)
            if parked is None or parked[0].is_finished():
                continue  # finished (aborted) meanwhile; the connector held its blocks
            request, target = parked
            if request_id in self.failed_async_loads:
                self.failed_async_loads.discard(request_id)
                failed.append((request, self._load_failure_message(request, target)))
                continue
            request.num_computed_tokens = target
            self.kv_cache_manager.cache_blocks(request, target)
            request.status = RequestStatus.WAITING
            self.async_load_done.add(request_id)
        for request_id in kv_output.finished_sending or ():
            sent = self.delayed_free.pop(request_id, None)
            if sent is not None:
                self.kv_cache_manager.free(sent)
        self._connector.update_connector_output(kv_output)
        return failed

    # ---- finishing -------------------------------------------------------------------------

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Forgets the request; returns whether the connector delays freeing its blocks,
        and the kv_transfer_params for its final output."""
        request_id = request.request_id
        self.async_loads.pop(request_id, None)
        self.failed_async_loads.discard(request_id)
        self.async_load_done.discard(request_id)
        self.sync_loaded.pop(request_id, None)
        block_ids = self.kv_cache_manager.get_block_ids(request_id)
        delay, params = self._connector.request_finished(request, block_ids[0] if block_ids else [])
        if delay:
            self.delayed_free[request_id] = request
        return delay, params

    def may_hold_blocks(self) -> set[str]:
        """Requests that hold blocks without running (integrity check)."""
        return {*self.async_loads, *self.async_load_done, *self.delayed_free}

    def has_delayed_frees(self) -> bool:
        # Blocks held for a connector's sends keep the engine stepping until released.
        return bool(self.delayed_free)

    def request_census(self) -> dict[str, int]:
        return {
            "async_loads": len(self.async_loads),
            "async_load_done": len(self.async_load_done),
            "failed_async_loads": len(self.failed_async_loads),
            "sync_loaded": len(self.sync_loaded),
            "delayed_free": len(self.delayed_free),
        }

    def make_stats(self) -> dict[str, dict[str, float]] | None:
        return self._connector.get_kv_connector_stats()

    def shutdown(self) -> None:
        self._connector.shutdown()
