"""RequestTable: the scheduler's requests and where each one is.

The only writer of the id map, the waiting queue, the running list, the ids finished
since the last step (the workers drop their state for these) and the outputs of requests
the scheduler itself ended (reported by the next update). Other collaborators read them;
they change only through the methods here, so a request is always in exactly one of
waiting / running while it is live.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from kvserve.core.request import Request, RequestStatus
from kvserve.core.sched.request_queue import RequestQueue, SchedulingPolicy, create_request_queue
from kvserve.protocol.engine_core import EngineCoreOutput


class RequestTable:
    def __init__(self, policy: SchedulingPolicy) -> None:
        self.policy = policy
        self.requests: dict[str, Request] = {}
        self.waiting: RequestQueue = create_request_queue(policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.pending_outputs: list[EngineCoreOutput] = []
        self.num_preemptions = 0
        # Wall-clock time each request first ran, until reported (the queue-time metric).
        self.scheduled_times: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def request_census(self) -> dict[str, int]:
        return {
            "requests": len(self.requests),
            "waiting": len(self.waiting),
            "running": len(self.running),
            "finished_req_ids": len(self.finished_req_ids),
            "pending_outputs": len(self.pending_outputs),
            "scheduled_times": len(self.scheduled_times),
        }

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.add_request(request)

    def get(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    # ---- moves between the queues ----------------------------------------------------------

    def start_running(self, request: Request) -> bool:
        """A request popped from waiting runs from now on; returns whether it resumes
        from preemption."""
        resumed = request.status == RequestStatus.PREEMPTED
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if not resumed:
            self.scheduled_times[request.request_id] = time.time()
        return resumed

    def lora_slots_full(self, request: Request, max_loras: int | None) -> bool:
        """Whether ``request`` needs an adapter beyond the max_loras the running ones use."""
        lora = request.lora_request
        if lora is None or max_loras is None:
            return False
        active = {r.lora_request.lora_int_id for r in self.running if r.lora_request}
        return lora.lora_int_id not in active and len(active) >= max_loras

    def pop_victim(self) -> Request:
        """Takes the running request to preempt out of running: the lowest priority (latest
        arrival) under the priority policy, else the last one."""
        if self.policy == SchedulingPolicy.PRIORITY:
            victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
            self.running.remove(victim)
            return victim
        return self.running.pop()

    def requeue_preempted(self, request: Request) -> None:
        """A request taken out of running (pop_victim, stop_running) waits again, first in
        line; its KV is gone, so it recomputes from the start."""
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        self.num_preemptions += 1
        self.waiting.prepend_request(request)

    def stop_running(self, request_ids: set[str]) -> list[Request]:
        """Takes these out of running (in their order there) and returns them."""
        taken = [r for r in self.running if r.request_id in request_ids]
        if taken:
            self.running = [r for r in self.running if r.request_id not in request_ids]
        return taken

    # ---- leaving --------------------------------------------------------------------------

    def remove(self, requests: Iterable[Request]) -> None:
        """Finished requests leave: from running or waiting (or neither, when the caller
        holds one it had popped), and from the id map; the workers hear of them next step."""
        gone = list(requests)
        if not gone:
            return
        ids = {r.request_id for r in gone}
        running = {r.request_id for r in self.stop_running(ids)}
        queued = [r for r in gone if r.request_id not in running]
        if queued:  # a request popped from waiting by the caller is in neither: ignored
            self.waiting.remove_requests(queued)
        for request in gone:
            self.requests.pop(request.request_id, None)
        self.finished_req_ids |= ids

    def take_finished_req_ids(self) -> set[str]:
        ids, self.finished_req_ids = self.finished_req_ids, set()
        return ids

    def add_pending_output(self, output: EngineCoreOutput) -> None:
        self.pending_outputs.append(output)

    def take_scheduled_times(self) -> dict[str, float] | None:
        times, self.scheduled_times = self.scheduled_times, {}
        return times or None

    def take_pending_outputs(self) -> list[EngineCoreOutput]:
        outputs, self.pending_outputs = self.pending_outputs, []
        return outputs
