"""Finding the request a failed model step is due to, by bisection over preemption.

A step that raises (a custom logits processor's bug, a kernel rejecting one request's
input) does not say which of its requests caused it. The scheduler finds out:

- A failed step with a single request is that request's: it ends with finish reason
  "error", its blocks freed (*attributed*).
- A failed step with several preempts them all by recompute, the tested path that a
  shortage of blocks takes, and makes them *suspects*. Their blocks that the step was
  filling leave the prefix cache first: the step may have stopped halfway through writing
  them. The next step is empty, so the workers drop every row of the failed batch
  (including per-row state the failure may have left half updated) and take the
  requests back later as resumed from preemption.
- From then on each step runs only the *probe*: the first half of the failed set, or once
  that is settled, the first half of the remaining suspects. Everything else waits, a few
  steps (about log2(n) per culprit). A probe member that samples in a step that succeeds
  is cleared and goes on as if nothing had happened: a greedy request produces exactly the
  tokens it would have; a seeded one too, unless the failed step had drawn from its
  generator before raising. A failing probe is halved again, down to a single request.
  Should no probe member be able to run (no free blocks, a KV load pending), the round is
  given up and scheduling goes on as usual.

The engine core dies only on failures no request could be blamed for: a round of
suspects that ends without a culprit (a transient fault, or requests that fail only
together), or a failed step that ran no request. `consecutive_unattributed_failures`
counts them; a step that succeeds outside a round resets it. Attributed failures do not
count, so no request, however often sent, takes the engine down; the price is that a
device that fails every step fails every request, one at a time, instead of dying.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.core.block_pool import require_integrity
from kvserve.core.request import Request, RequestStatus
from kvserve.protocol.engine_core import EngineCoreOutput, FinishReason
from kvserve.protocol.scheduler_output import CachedRequestData, SchedulerOutput

if TYPE_CHECKING:
    from kvserve.core.kv_cache_manager import KVCacheManager
    from kvserve.core.sched.request_queue import RequestQueue
    from kvserve.distributed.kv_transfer.kv_connector.base import KVConnectorBase_V1


class SchedulerIsolationMixin:
    # Provided by the Scheduler.
    kv_cache_manager: KVCacheManager
    block_size: int
    enable_caching: bool
    requests: dict[str, Request]
    running: list[Request]
    waiting: RequestQueue
    finished_req_ids: set[str]
    connector: KVConnectorBase_V1 | None
    _pending_outputs: list[EngineCoreOutput]

    if TYPE_CHECKING:

        def _finish_with_error(self, request: Request, message: str) -> None: ...
        def _preempt(self, request: Request) -> None: ...
        def _release_in_flight(self, scheduler_output: SchedulerOutput) -> None: ...

    def _init_isolation(self) -> None:
        # Insertion-ordered set of the requests still under suspicion.
        self._suspects: dict[str, None] = {}
        # The suspects the next steps may run (a subset of _suspects, chosen lazily).
        self._probe: set[str] = set()
        # A failed step's requests, for the empty step that drops them from the workers.
        self._flush_ids: set[str] = set()
        # Whether the current round already counts as unattributed (until a culprit).
        self._round_counted = False
        self.consecutive_unattributed_failures = 0

    @property
    def is_isolating(self) -> bool:
        return bool(self._suspects)

    # ---- the failed step -----------------------------------------------------------------

    def isolate_failed_step(
        self, scheduler_output: SchedulerOutput, message: str
    ) -> list[EngineCoreOutput]:
        """Blames a lone request, or turns the step's requests into suspects; returns the
        outputs of requests this ended (the culprit's, carrying ``message``)."""
        self._release_in_flight(scheduler_output)
        self._undo_partial_update(scheduler_output, message)
        failed = [
            r
            for rid in scheduler_output.num_scheduled_tokens
            if (r := self.requests.get(rid)) is not None and r.status == RequestStatus.RUNNING
        ]
        self._evict_step_blocks(scheduler_output, failed)
        failed_ids = {r.request_id for r in failed}
        self.running = [r for r in self.running if r.request_id not in failed_ids]
        if len(failed) == 1:
            if self._round_counted:  # the round found its culprit: it was no fault of ours
                self.consecutive_unattributed_failures -= 1
                self._round_counted = False
            self._finish_with_error(failed[0], message)
        elif not failed:
            self.consecutive_unattributed_failures += 1
        else:
            if not self._suspects:
                self.consecutive_unattributed_failures += 1
                self._round_counted = True
            # Suspects of the old probe that this step left out go back to waiting too:
            # only the new probe may run.
            idle = [r for r in self.running if r.request_id in self._suspects]
            self.running = [r for r in self.running if r.request_id not in self._suspects]
            for request in reversed(failed + idle):  # prepended one by one: keeps order
                self._preempt(request)
            for request in failed:
                self._suspects[request.request_id] = None
            self._probe = {r.request_id for r in failed[: (len(failed) + 1) // 2]}
            self._flush_ids |= failed_ids
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def _undo_partial_update(self, scheduler_output: SchedulerOutput, message: str) -> None:
        """If update_from_output raised halfway, tokens it appended were never reported:
        they are dropped (the rerun samples them again). A request it finished and freed
        has lost its final output: that request ends with the error instead, so that its
        caller does not wait forever (one aborted meanwhile is ignored by the front end)."""
        cached = scheduler_output.scheduled_cached_reqs
        num_output = dict(zip(cached.req_ids, cached.num_output_tokens, strict=True))
        for new in scheduler_output.scheduled_new_reqs:
            num_output[new.req_id] = len(new.output_token_ids)
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is None:
                self._pending_outputs.append(
                    EngineCoreOutput(
                        request_id=request_id,
                        new_token_ids=[],
                        finish_reason=FinishReason.ERROR,
                        error=message,
                    )
                )
            elif request_id in num_output:
                request.truncate_output_token_ids(num_output[request_id], self.block_size)
        self.running = [r for r in self.running if r.request_id in self.requests]

    def _evict_step_blocks(self, scheduler_output: SchedulerOutput, failed: list[Request]) -> None:
        # From the block holding the step's first token on, a block's KV may be half written
        # (allocate_slots cached it ahead of the forward): nobody may hit it later.
        if not self.enable_caching:
            return
        pool = self.kv_cache_manager.block_pool
        for request in failed:
            start = (
                request.num_computed_tokens
                - scheduler_output.num_scheduled_tokens[request.request_id]
            )
            for block_ids in self.kv_cache_manager.get_block_ids(request.request_id):
                pool.evict_blocks(block_ids[start // self.block_size :])

    # ---- schedule() ----------------------------------------------------------------------

    def _take_flush(self) -> SchedulerOutput | None:
        """The empty step right after a failure, or None when none is due."""
        if not self._flush_ids:
            return None
        output = SchedulerOutput(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=CachedRequestData(),
            num_scheduled_tokens={},
            total_num_scheduled_tokens=0,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=self._flush_ids,
        )
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        self.finished_req_ids = set()
        self._flush_ids = set()
        return output

    def _current_probe(self) -> set[str]:
        if not self._probe:
            suspects = list(self._suspects)
            self._probe = set(suspects[: (len(suspects) + 1) // 2])
        return self._probe

    def _abandon_isolation(self) -> None:
        """Nothing of the probe could run (no blocks, a KV load pending): schedule as usual
        again; the round counts as unattributed."""
        self._suspects.clear()
        self._end_round()

    # ---- update_from_output() and finishing ---------------------------------------------

    def _clear_suspects(self, request_ids: list[str]) -> None:
        """These probe members sampled in a step that succeeded: no longer suspects."""
        for request_id in request_ids:
            self._forget_suspect(request_id)

    def _forget_suspect(self, request_id: str) -> None:
        if request_id in self._suspects:
            del self._suspects[request_id]
            self._probe.discard(request_id)
            if not self._suspects:
                self._end_round()

    def _end_round(self) -> None:
        self._probe.clear()
        self._flush_ids = set()
        self._round_counted = False

    def _check_isolation_integrity(self) -> None:
        require_integrity(self._probe <= self._suspects.keys(), "a probe member is no suspect")
        require_integrity(self._suspects.keys() <= self.requests.keys(), "a suspect is gone")
        for request in self.running:
            require_integrity(
                request.request_id not in self._suspects or request.request_id in self._probe,
                f"{request} runs while a suspect outside the probe",
            )
        require_integrity(
            bool(self._suspects) or not self._round_counted, "a round counted without suspects"
        )
