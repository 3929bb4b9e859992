"""Waiting queues of the scheduler: first come first served, or by priority."""

from __future__ import annotations

import enum
import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from kvserve.core.request import Request


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class RequestQueue(ABC):
    @abstractmethod
    def add_request(self, request: Request) -> None: ...

    @abstractmethod
    def pop_request(self) -> Request: ...

    @abstractmethod
    def peek_request(self) -> Request: ...

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """Puts a request back in front (preempted or skipped), as far as the policy allows."""

    @abstractmethod
    def prepend_requests(self, requests: RequestQueue) -> None: ...

    @abstractmethod
    def remove_request(self, request: Request) -> None: ...

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Requests in the order they would be popped."""

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def peek_request(self) -> Request:
        if not self._queue:
            raise IndexError("peek from an empty queue")
        return self._queue[0]

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def prepend_requests(self, requests: RequestQueue) -> None:
        # extendleft reverses, so reverse first to keep their order in front.
        self._queue.extendleft(reversed(list(requests)))

    def remove_request(self, request: Request) -> None:
        self._queue.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        doomed = {id(r) for r in requests}
        self._queue = deque(r for r in self._queue if id(r) not in doomed)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._queue))


class PriorityRequestQueue(RequestQueue):
    """A heap on (priority, arrival_time, request_id): lower values are served first."""

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def pop_request(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty queue")
        return heapq.heappop(self._heap)

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0]

    def prepend_request(self, request: Request) -> None:
        # Priority order decides; a preempted request keeps its original arrival time.
        self.add_request(request)

    def prepend_requests(self, requests: RequestQueue) -> None:
        for request in requests:
            self.add_request(request)

    def remove_request(self, request: Request) -> None:
        self.remove_requests([request])

    def remove_requests(self, requests: Iterable[Request]) -> None:
        doomed = {id(r) for r in requests}
        self._heap = [r for r in self._heap if id(r) not in doomed]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap))


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    if policy == SchedulingPolicy.FCFS:
        return FCFSRequestQueue()
    if policy == SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}")
