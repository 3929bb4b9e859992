"""RequestTable alone: where each request is, and what leaves it (no model, no blocks)."""

from __future__ import annotations

from kvserve.core.request import RequestStatus
from kvserve.core.sched.request_queue import SchedulingPolicy
from kvserve.core.sched.request_table import RequestTable
from kvserve.protocol.engine_core import EngineCoreOutput
from tests.core.conftest import MakeRequest


def test_a_request_is_in_exactly_one_place(make_request: MakeRequest) -> None:
    table = RequestTable(SchedulingPolicy.FCFS)
    a, b = make_request(4, "a"), make_request(4, "b")
    table.add(a)
    table.add(b)
    assert len(table) == 2 and [r.request_id for r in table.waiting] == ["a", "b"]
    assert table.start_running(table.waiting.pop_request()) is False  # new, not resumed
    assert a.status == RequestStatus.RUNNING and table.running == [a]
    assert list(table.waiting) == [b]


def test_preemption_requeues_first_in_line_and_resumes(make_request: MakeRequest) -> None:
    table = RequestTable(SchedulingPolicy.FCFS)
    a, b, c = (make_request(4, rid) for rid in "abc")
    for request in (a, b, c):
        table.add(request)
    table.start_running(table.waiting.pop_request())
    table.start_running(table.waiting.pop_request())
    b.num_computed_tokens, b.spec_token_ids = 4, [9]
    victim = table.pop_victim()  # FCFS: the last one running
    assert victim is b and table.running == [a]
    table.requeue_preempted(victim)
    assert [r.request_id for r in table.waiting] == ["b", "c"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.spec_token_ids == [] and table.num_preemptions == 1
    assert table.start_running(table.waiting.pop_request()) is True  # resumed


def test_priority_victim_is_the_lowest_priority_then_latest(make_request: MakeRequest) -> None:
    table = RequestTable(SchedulingPolicy.PRIORITY)
    urgent, late, lazy = (
        make_request(4, "urgent", priority=0),
        make_request(4, "late", priority=1),
        make_request(4, "lazy", priority=1, arrival_time=-1.0),
    )
    for request in (lazy, urgent, late):
        table.add(request)
        table.start_running(table.waiting.pop_request())
    assert table.pop_victim() is late
    assert table.pop_victim() is lazy
    assert table.running == [urgent]


def test_remove_takes_requests_from_wherever_they_are(make_request: MakeRequest) -> None:
    table = RequestTable(SchedulingPolicy.FCFS)
    running, waiting, popped = make_request(4, "r"), make_request(4, "w"), make_request(4, "p")
    for request in (running, waiting, popped):
        table.add(request)
    table.start_running(table.waiting.pop_request())
    table.waiting.remove_request(popped)  # the caller holds it, as schedule() may
    table.remove([running, waiting, popped])
    assert not table.requests and not table.running and not table.waiting and len(table) == 0
    assert table.take_finished_req_ids() == {"r", "w", "p"}
    assert table.take_finished_req_ids() == set()


def test_pending_outputs_are_taken_once(make_request: MakeRequest) -> None:
    table = RequestTable(SchedulingPolicy.FCFS)
    output = EngineCoreOutput(request_id="x", new_token_ids=[])
    table.add_pending_output(output)
    assert table.take_pending_outputs() == [output]
    assert table.take_pending_outputs() == []


def test_stop_running_keeps_the_order_of_running(make_request: MakeRequest) -> None:
    table = RequestTable(SchedulingPolicy.FCFS)
    requests = [make_request(4, rid) for rid in "abcd"]
    for request in requests:
        table.add(request)
        table.start_running(table.waiting.pop_request())
    assert [r.request_id for r in table.stop_running({"d", "b"})] == ["b", "d"]
    assert [r.request_id for r in table.running] == ["a", "c"]
