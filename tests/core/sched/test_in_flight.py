"""InFlightBatches alone: each request in at most one unapplied micro-batch."""

from __future__ import annotations

import pytest

from kvserve.core.sched.in_flight import InFlightBatches
from kvserve.core.sched.step_plan import empty_step_output


def _step(*req_ids: str):  # type: ignore[no-untyped-def]
    out = empty_step_output(set(), set())
    out.num_scheduled_tokens = dict.fromkeys(req_ids, 1)
    return out


def test_one_batch_at_a_time_tracks_nothing() -> None:
    batches = InFlightBatches(1, max_num_running_reqs=8)
    batches.mark(_step("a"))
    assert not batches.in_flight and batches.request_cap(100) == 8


def test_micro_batches_share_the_requests_and_hold_them_until_applied() -> None:
    batches = InFlightBatches(2, max_num_running_reqs=8)
    assert batches.request_cap(5) == 3 and batches.request_cap(100) == 4
    assert batches.request_cap(0) == 1
    first, second = _step("a", "b"), _step("c")
    batches.mark(first)
    batches.mark(second)
    assert batches.in_flight == {"a", "b", "c"}
    batches.release(first)
    assert batches.in_flight == {"c"}


def test_a_batch_queue_needs_a_positive_depth() -> None:
    with pytest.raises(ValueError, match="max_concurrent_batches"):
        InFlightBatches(0, max_num_running_reqs=8)
