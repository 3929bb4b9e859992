"""InFlightBatches: the scheduler's side of the engine's batch queue.

Pipeline parallelism: with ``max_concurrent_batches > 1`` the engine core schedules a
new micro-batch while earlier ones are still in the pipeline. A request's next step
needs the token its current one samples, so a request in an in-flight batch is never
scheduled again until that batch's output has been applied (vLLM's rule): each request
is in at most one in-flight batch. Requests that are aborted, finished or preempted
while in flight stay marked until their batch comes back, so a preempted one cannot
resume (and take that batch's token twice) before it. Each micro-batch takes at most
its share of the requests (live requests over the number of batches, rounded up):
otherwise the first batch would take every request and the others would stay empty,
leaving all but one stage idle.

Async scheduling (vLLM's AsyncScheduler): one worker, two batches in flight. A request
that samples in batch N gets an output placeholder (``Request.num_output_placeholders``)
and is scheduled again in batch N+1 at once: the scheduler computes the placeholder's
position, and the worker, which runs its calls in order, has appended the sampled token
to its own copy of the request before it prepares N+1. When N's output is applied the
placeholder becomes the token. A request whose next step needs more than that token
(a grammar: N+1's bitmask follows from N's token) waits for its batch as under
pipeline parallelism. A request preempted while in flight forgets its placeholders:
the sample of its old run is not taken.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.core.request import Request
    from kvserve.protocol.scheduler_output import SchedulerOutput


class InFlightBatches:
    """The only writer of the set of requests in batches not yet applied, and of the
    requests' output placeholders."""

    def __init__(
        self,
        max_concurrent_batches: int,
        max_num_running_reqs: int,
        async_scheduling: bool = False,
        max_model_len: int = 0,
    ) -> None:
        if max_concurrent_batches < 1:
            raise ValueError(f"max_concurrent_batches must be >= 1, got {max_concurrent_batches}")
        self.max_concurrent_batches = max_concurrent_batches
        self.max_num_running_reqs = max_num_running_reqs
        self.async_scheduling = async_scheduling
        self.max_model_len = max_model_len
        # Ids that may not be scheduled until the batch they are in has been applied.
        self.in_flight: set[str] = set()
        # Async: per batch in flight (by the output's identity), the requests whose sample
        # in it counts, each holding one placeholder until it is applied.
        self._sampling: dict[int, dict[str, Request]] = {}

    def request_census(self) -> dict[str, int]:
        return {
            "in_flight": len(self.in_flight),
            "sampling": sum(len(s) for s in self._sampling.values()),
        }

    def request_cap(self, num_live: int) -> int:
        """How many of the ``num_live`` requests this micro-batch may take."""
        if self.max_concurrent_batches == 1 or self.async_scheduling:
            return self.max_num_running_reqs
        live = min(num_live, self.max_num_running_reqs)
        return max(1, -(-live // self.max_concurrent_batches))

    def blocks(self, request: Request) -> bool:
        """Whether ``request`` must wait for its batch to come back before it is scheduled
        again; async: also whether the tokens in flight finish it (max_tokens or the
        model's length), so that another step would compute a token nobody gets."""
        if request.request_id in self.in_flight:
            return True
        placeholders = request.num_output_placeholders
        return placeholders > 0 and (
            request.num_output_tokens + placeholders >= (request.max_tokens or 0) > 0
            or request.num_tokens + placeholders >= self.max_model_len > 0
        )

    def mark(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Called once the step's requests have advanced their num_computed_tokens."""
        if not self.async_scheduling:
            if self.max_concurrent_batches > 1:
                self.in_flight.update(scheduler_output.num_scheduled_tokens)
            return
        sampling: dict[str, Request] = {}
        for request_id in scheduler_output.num_scheduled_tokens:
            request = requests[request_id]
            if request.structured_output_request is not None:
                self.in_flight.add(request_id)
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                # Caught up: the step samples its next token.
                request.num_output_placeholders += 1
                sampling[request_id] = request
        self._sampling[id(scheduler_output)] = sampling

    def takes_sample(self, scheduler_output: SchedulerOutput, request: Request) -> bool:
        """Whether the batch's sampled tokens for ``request`` are its next ones: it was
        caught up when the batch was scheduled and has not been preempted since."""
        if not self.async_scheduling:
            return request.num_computed_tokens >= request.num_tokens
        sampling = self._sampling.get(id(scheduler_output))
        return sampling is not None and request.request_id in sampling

    def release(self, scheduler_output: SchedulerOutput) -> None:
        """The batch's output is back (or it failed): its requests may run again and its
        placeholders end (applied tokens took their place)."""
        if self.in_flight:
            self.in_flight.difference_update(scheduler_output.num_scheduled_tokens)
        for request in self._sampling.pop(id(scheduler_output), {}).values():
            request.num_output_placeholders -= 1

    def forget(self, request: Request) -> None:
        """``request`` was preempted: samples in flight are not its next tokens any more
        (it recomputes from what it has)."""
        if not request.num_output_placeholders:
            return
        for sampling in self._sampling.values():
            sampling.pop(request.request_id, None)
        request.num_output_placeholders = 0
