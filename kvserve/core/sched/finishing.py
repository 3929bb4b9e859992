"""Requests leaving the scheduler: finished by the engine (stop, abort) or failed.

A finished request frees its blocks unless the KV connector still sends from them
(delayed free), releases its encoder cache entries, and is reported to the workers
through finished_req_ids so they drop its state on the next step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvserve.core.request import Request, RequestStatus
from kvserve.protocol.engine_core import EngineCoreOutput

if TYPE_CHECKING:
    from kvserve.core.kv_cache_manager import KVCacheManager
    from kvserve.core.sched.request_queue import RequestQueue


class SchedulerFinishingMixin:
    # Provided by the Scheduler and its other mixins.
    kv_cache_manager: KVCacheManager
    requests: dict[str, Request]
    running: list[Request]
    waiting: RequestQueue
    finished_req_ids: set[str]
    _pending_outputs: list[EngineCoreOutput]
    _suspects: dict[str, None]

    if TYPE_CHECKING:

        def _connector_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]: ...
        def _free_encoder(self, request: Request) -> None: ...
        def _forget_suspect(self, request_id: str) -> None: ...

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        assert RequestStatus.is_finished(finished_status)
        ids = (request_ids,) if isinstance(request_ids, str) else request_ids
        finished_running: set[str] = set()
        finished_waiting: list[Request] = []
        for request_id in ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                finished_running.add(request_id)
            else:
                finished_waiting.append(request)
            request.status = finished_status
            self._free_request(request)
        if finished_running:
            self.running = [r for r in self.running if r.request_id not in finished_running]
        if finished_waiting:
            self.waiting.remove_requests(finished_waiting)

    def fail_requests(self, request_ids: Iterable[str], message: str) -> list[EngineCoreOutput]:
        """Ends the unfinished ones among ``request_ids`` with finish reason "error" and
        frees their blocks; returns their final outputs (carrying ``message``)."""
        failed = [r for rid in request_ids if (r := self.requests.get(rid)) and not r.is_finished()]
        running = {r.request_id for r in failed if r.status == RequestStatus.RUNNING}
        waiting = [r for r in failed if r.request_id not in running]
        if running:
            self.running = [r for r in self.running if r.request_id not in running]
        if waiting:
            self.waiting.remove_requests(waiting)
        for request in failed:
            self._finish_with_error(request, message)
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def _free_request(self, request: Request) -> dict[str, Any] | None:
        """Frees its blocks (unless the KV connector still sends); returns kv_transfer_params."""
        delay_free, kv_transfer_params = self._connector_finished(request)
        if not delay_free:
            self.kv_cache_manager.free(request)
        self._free_encoder(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        if self._suspects:
            self._forget_suspect(request.request_id)
        return kv_transfer_params

    def _finish_with_error(self, request: Request, message: str) -> None:
        request.status = RequestStatus.FINISHED_ERROR
        request.error = message
        output = EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[],
            finish_reason=request.get_finished_reason(),
            error=message,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )
        self._pending_outputs.append(output)
        output.kv_transfer_params = self._free_request(request)
