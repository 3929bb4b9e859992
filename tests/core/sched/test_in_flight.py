"""InFlightBatches alone: each request in at most one unapplied micro-batch (pipeline
parallelism), or one step ahead of its sampled tokens on placeholders (async scheduling)."""

from __future__ import annotations

import pytest

from kvserve.core.request import Request
from kvserve.core.sched.in_flight import InFlightBatches
from kvserve.core.sched.step_plan import empty_step_output
from kvserve.sampling_params import StructuredOutputsParams
from tests.core.conftest import MakeRequest


def _step(*req_ids: str):  # type: ignore[no-untyped-def]
    out = empty_step_output(set(), set())
    out.num_scheduled_tokens = dict.fromkeys(req_ids, 1)
    return out


def test_one_batch_at_a_time_tracks_nothing() -> None:
    batches = InFlightBatches(1, max_num_running_reqs=8)
    batches.mark(_step("a"), {})
    assert not batches.in_flight and batches.request_cap(100) == 8


def test_micro_batches_share_the_requests_and_hold_them_until_applied() -> None:
    batches = InFlightBatches(2, max_num_running_reqs=8)
    assert batches.request_cap(5) == 3 and batches.request_cap(100) == 4
    assert batches.request_cap(0) == 1
    first, second = _step("a", "b"), _step("c")
    batches.mark(first, {})
    batches.mark(second, {})
    assert batches.in_flight == {"a", "b", "c"}
    batches.release(first)
    assert batches.in_flight == {"c"}


def test_a_batch_queue_needs_a_positive_depth() -> None:
    with pytest.raises(ValueError, match="max_concurrent_batches"):
        InFlightBatches(0, max_num_running_reqs=8)


# ---- async scheduling: output placeholders ------------------------------------------------


def _scheduled(batches: InFlightBatches, requests: dict[str, Request], **tokens: int):  # type: ignore[no-untyped-def]
    """Schedules ``tokens[id]`` tokens per request as Scheduler._finish_plan does."""
    out = _step(*tokens)
    out.num_scheduled_tokens = dict(tokens)
    for request_id, n in tokens.items():
        requests[request_id].num_computed_tokens += n
    batches.mark(out, requests)
    return out


def test_async_a_caught_up_request_runs_ahead_on_a_placeholder(make_request: MakeRequest) -> None:
    batches = InFlightBatches(2, max_num_running_reqs=8, async_scheduling=True, max_model_len=64)
    assert batches.request_cap(100) == 8  # one batch takes every request
    a, b = make_request(8, "a", max_tokens=3), make_request(20, "b")
    requests = {"a": a, "b": b}
    first = _scheduled(batches, requests, a=8, b=12)  # b: a partial prefill samples nothing
    assert a.num_output_placeholders == 1 and b.num_output_placeholders == 0
    assert not batches.blocks(a) and not batches.blocks(b)
    # Batch 2 is scheduled before batch 1 comes back: a computes its placeholder's position.
    second = _scheduled(batches, requests, a=1, b=8)
    assert a.num_output_placeholders == 2 and b.num_output_placeholders == 1
    assert batches.takes_sample(first, a) and not batches.takes_sample(first, b)
    assert batches.takes_sample(second, b)
    a.append_output_token_ids(7)
    batches.release(first)
    assert a.num_output_placeholders == 1 and batches.request_census()["sampling"] == 2
    # max_tokens=3: one token out, two in flight would be the last ones; no third step.
    third = _scheduled(batches, requests, a=1)
    assert batches.blocks(a)
    for out in (second, third):
        batches.release(out)
    assert a.num_output_placeholders == b.num_output_placeholders == 0
    assert batches.request_census() == {"in_flight": 0, "sampling": 0}


def test_async_a_preempted_request_forgets_its_samples_in_flight(make_request: MakeRequest) -> None:
    batches = InFlightBatches(2, max_num_running_reqs=8, async_scheduling=True, max_model_len=64)
    a = make_request(8, "a")
    out = _scheduled(batches, {"a": a}, a=8)
    batches.forget(a)  # the releaser's preempt
    assert a.num_output_placeholders == 0 and not batches.takes_sample(out, a)
    batches.release(out)
    assert a.num_output_placeholders == 0


def test_async_a_constrained_request_waits_for_its_batch(make_request: MakeRequest) -> None:
    batches = InFlightBatches(2, max_num_running_reqs=8, async_scheduling=True, max_model_len=64)
    a = make_request(8, "a", structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    out = _scheduled(batches, {"a": a}, a=8)
    assert batches.blocks(a)  # its next bitmask follows from the token in flight
    batches.release(out)
    assert not batches.blocks(a)


def test_async_the_model_length_bounds_placeholders(make_request: MakeRequest) -> None:
    batches = InFlightBatches(2, max_num_running_reqs=8, async_scheduling=True, max_model_len=9)
    a = make_request(8, "a", max_tokens=100)
    _scheduled(batches, {"a": a}, a=8)
    assert batches.blocks(a)  # its 9th token ends it at max_model_len
