"""InFlightBatches: the scheduler's side of the engine's batch queue (pipeline parallelism).

With ``max_concurrent_batches > 1`` the engine core schedules a new micro-batch while
earlier ones are still in the pipeline. A request's next step needs the token its
current one samples, so a request in an in-flight batch is never scheduled again until
that batch's output has been applied (vLLM's rule): each request is in at most one
in-flight batch. Requests that are aborted, finished or preempted while in flight stay
marked until their batch comes back, so a preempted one cannot resume (and take that
batch's token twice) before it.

Each micro-batch takes at most its share of the requests (live requests over the number
of batches, rounded up): otherwise the first batch would take every request and the
others would stay empty, leaving all but one stage idle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.protocol.scheduler_output import SchedulerOutput


class InFlightBatches:
    """The only writer of the set of requests in batches not yet applied."""

    def __init__(self, max_concurrent_batches: int, max_num_running_reqs: int) -> None:
        if max_concurrent_batches < 1:
            raise ValueError(f"max_concurrent_batches must be >= 1, got {max_concurrent_batches}")
        self.max_concurrent_batches = max_concurrent_batches
        self.max_num_running_reqs = max_num_running_reqs
        # Ids scheduled in a batch whose output update_from_output has not applied yet.
        self.in_flight: set[str] = set()

    def request_census(self) -> dict[str, int]:
        return {"in_flight": len(self.in_flight)}

    def request_cap(self, num_live: int) -> int:
        """How many of the ``num_live`` requests this micro-batch may take."""
        if self.max_concurrent_batches == 1:
            return self.max_num_running_reqs
        live = min(num_live, self.max_num_running_reqs)
        return max(1, -(-live // self.max_concurrent_batches))

    def mark(self, scheduler_output: SchedulerOutput) -> None:
        if self.max_concurrent_batches > 1:
            self.in_flight.update(scheduler_output.num_scheduled_tokens)

    def release(self, scheduler_output: SchedulerOutput) -> None:
        """The batch's output is back (or it failed): its requests may run again."""
        if self.in_flight:
            self.in_flight.difference_update(scheduler_output.num_scheduled_tokens)
