"""RequestReleaser: what a request holds across the collaborators, given back in one place.

A request that finishes, fails or is preempted holds blocks (KVCacheManager), maybe a
connector's claim on them (the KV-transfer planner), encoder cache entries (the encoder
planner), maybe suspicion (the FailureIsolator) and maybe samples in flight (async
scheduling's placeholders). The schedule side and the results
side of the scheduler both end and preempt requests; they do it through this object, so
nothing is released twice or forgotten.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvserve.core.request import Request, RequestStatus
from kvserve.protocol.engine_core import EngineCoreOutput

if TYPE_CHECKING:
    from kvserve.core.kv_cache_manager import KVCacheManager
    from kvserve.core.sched.encoder_planner import NoEncoderPlanner
    from kvserve.core.sched.failure_isolator import FailureIsolator
    from kvserve.core.sched.in_flight import InFlightBatches
    from kvserve.core.sched.kv_transfer_planner import NoKVTransfer
    from kvserve.core.sched.request_table import RequestTable


class RequestReleaser:
    def __init__(
        self,
        table: RequestTable,
        kv_cache_manager: KVCacheManager,
        kv_transfer: NoKVTransfer,
        encoder: NoEncoderPlanner,
        isolator: FailureIsolator,
        batches: InFlightBatches,
    ) -> None:
        self.table = table
        self.kv_cache_manager = kv_cache_manager
        self.kv_transfer = kv_transfer
        self.encoder = encoder
        self.isolator = isolator
        self.batches = batches

    def free(self, request: Request) -> dict[str, Any] | None:
        """Releases what a finished request holds (its blocks, unless the KV connector
        still sends from them); returns its kv_transfer_params. The caller takes it out of
        the request table."""
        delay_free, kv_transfer_params = self.kv_transfer.request_finished(request)
        if not delay_free:
            self.kv_cache_manager.free(request)
        self.encoder.free(request)
        self.isolator.forget(request.request_id)
        return kv_transfer_params

    def fail(self, request: Request, message: str) -> None:
        """Ends a request with finish reason "error"; its final output goes out with the
        next update."""
        request.status = RequestStatus.FINISHED_ERROR
        request.error = message
        output = EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[],
            finish_reason=request.get_finished_reason(),
            error=message,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )
        output.kv_transfer_params = self.free(request)
        self.table.remove([request])
        self.table.add_pending_output(output)

    def preempt(self, request: Request) -> None:
        """Recompute: drops a request's KV (its full blocks stay cached) and its encoder
        outputs; the caller took it out of running, and it waits first in line."""
        self.kv_cache_manager.free(request)
        self.encoder.free(request)
        self.batches.forget(request)  # async scheduling: it recomputes from what it has
        request.num_preemptions += 1
        self.table.requeue_preempted(request)
