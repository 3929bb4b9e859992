"""FCFS and priority waiting queues."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvserve.core.request import Request
from kvserve.core.sched.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    SchedulingPolicy,
    create_request_queue,
)

MakeRequest = Callable[..., Request]


def rids(queue: object) -> list[str]:
    return [r.request_id for r in queue]  # type: ignore[attr-defined]


def test_fcfs_queue_operations(make_request: MakeRequest) -> None:
    queue = create_request_queue(SchedulingPolicy.FCFS)
    assert isinstance(queue, FCFSRequestQueue) and not queue and len(queue) == 0
    a, b, c, d = (make_request(4, request_id=x) for x in "abcd")
    for r in (a, b, c):
        queue.add_request(r)
    assert queue.peek_request() is a and rids(queue) == ["a", "b", "c"]
    assert queue.pop_request() is a
    queue.prepend_request(d)
    assert rids(queue) == ["d", "b", "c"]
    front = FCFSRequestQueue()
    front.add_request(a)
    front.add_request(a.__class__("e", [1], a.sampling_params, None))
    queue.prepend_requests(front)
    assert rids(queue) == ["a", "e", "d", "b", "c"]
    queue.remove_request(d)
    queue.remove_requests([b, a])
    assert rids(queue) == ["e", "c"] and bool(queue) and len(queue) == 2


def test_priority_queue_orders_by_priority_then_arrival(make_request: MakeRequest) -> None:
    queue = create_request_queue(SchedulingPolicy.PRIORITY)
    assert isinstance(queue, PriorityRequestQueue)
    late_urgent = make_request(4, request_id="late_urgent", priority=0, arrival_time=5.0)
    early_lazy = make_request(4, request_id="early_lazy", priority=3, arrival_time=1.0)
    early_urgent = make_request(4, request_id="early_urgent", priority=0, arrival_time=2.0)
    for r in (early_lazy, late_urgent, early_urgent):
        queue.add_request(r)
    assert rids(queue) == ["early_urgent", "late_urgent", "early_lazy"]
    assert queue.peek_request() is early_urgent
    assert queue.pop_request() is early_urgent
    queue.prepend_request(early_urgent)  # priority decides, not the call
    assert queue.peek_request() is early_urgent
    queue.remove_request(late_urgent)
    assert rids(queue) == ["early_urgent", "early_lazy"]
    queue.remove_requests([early_urgent, early_lazy])
    assert not queue
    with pytest.raises(IndexError):
        queue.pop_request()
    with pytest.raises(IndexError):
        queue.peek_request()
