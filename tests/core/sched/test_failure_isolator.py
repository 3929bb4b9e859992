"""The scheduler's side of a failed step: bisection over preempted suspects (isolation.py).

The Driver plays the workers and fails a step as a model step that raises would; the
real model behind it is in tests/engine_core/test_core_isolation.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from kvserve.core.request import Request, RequestStatus
from kvserve.core.sched.failure_isolator import MAX_UNATTRIBUTED_STEP_FAILURES, FailureIsolator
from kvserve.protocol.engine_core import FinishReason
from kvserve.protocol.runner_output import ModelRunnerOutput
from tests.core.sched.driver import TOKEN, Driver

MakeRequest = Callable[..., Request]


def _requests(make_request: MakeRequest, n: int, max_tokens: int = 3) -> list[Request]:
    return [
        make_request(list(range(100 * i, 100 * i + 6)), f"r{i}", max_tokens=max_tokens)
        for i in range(1, n + 1)
    ]


def test_the_culprit_is_found_by_halving_and_only_it_fails(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    driver = make_driver()
    sched = driver.scheduler
    driver.add(*_requests(make_request, 4))
    pool = sched.kv_cache_manager.block_pool
    culprit = {"r3"}

    out, outputs = driver.step(fail_if=culprit)
    assert set(out.num_scheduled_tokens) == {"r1", "r2", "r3", "r4"} and not outputs.outputs
    assert sched.is_isolating and sched.consecutive_unattributed_failures == 1
    # The step was to fill their first blocks; none of them may be hit later.
    assert not pool.cached_block_hash_to_block
    # One empty step: the workers drop the failed batch's rows.
    out, _ = driver.step(fail_if=culprit)
    assert out.total_num_scheduled_tokens == 0
    assert out.preempted_req_ids == {"r1", "r2", "r3", "r4"}
    # The first half runs alone, and passes.
    out, _ = driver.step(fail_if=culprit)
    assert set(out.num_scheduled_tokens) == {"r1", "r2"}
    assert all(o.new_token_ids == [TOKEN] for o in driver.outputs["r1"] + driver.outputs["r2"])
    # Half of the rest: the culprit alone, which fails and ends with an error.
    out, outputs = driver.step(fail_if=culprit)
    assert set(out.num_scheduled_tokens) == {"r3"}
    assert [(o.request_id, o.finish_reason) for o in outputs.outputs] == [
        ("r3", FinishReason.ERROR)
    ]
    assert outputs.outputs[0].error == "RuntimeError: the step failed"
    assert sched.consecutive_unattributed_failures == 0  # the round found its culprit
    out, _ = driver.step(fail_if=culprit)
    assert set(out.num_scheduled_tokens) == {"r4"}
    assert not sched.is_isolating
    # Everyone else goes on together, with every token it was owed.
    driver.run()
    for rid in ("r1", "r2", "r4"):
        assert driver.finish_reason(rid) == FinishReason.LENGTH
        assert driver.tokens(rid) == [TOKEN] * 3
    assert sched.num_preemptions == 4


def test_blocks_of_earlier_steps_stay_cached_and_are_hit_on_the_rerun(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    driver = make_driver()
    sched = driver.scheduler
    pool = sched.kv_cache_manager.block_pool
    first = make_request(list(range(200, 208)), "first", max_tokens=4)
    driver.add(first)
    driver.step()  # its two full prompt blocks are computed and cached
    cached = dict(pool.cached_block_hash_to_block)
    assert len(cached) == 2
    driver.add(make_request(list(range(300, 309)), "bad", max_tokens=4))
    driver.step(fail_if={"bad"})  # first decodes, bad prefills: fails
    assert pool.cached_block_hash_to_block == cached  # only bad's new blocks left the cache
    hits = 0
    for _ in range(6):
        _, outputs = driver.step(fail_if={"bad"})
        hits += outputs.scheduler_stats.prefix_cache_hits if outputs.scheduler_stats else 0
    assert driver.finish_reason("bad") == FinishReason.ERROR
    assert hits == 8  # first's rerun started from its two cached blocks
    driver.run()
    assert driver.tokens("first") == [TOKEN] * 4


def test_others_wait_during_the_round_and_aborted_suspects_leave_it(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    driver = make_driver()
    sched = driver.scheduler
    driver.add(*_requests(make_request, 2))
    driver.step(fail_if={"r1"})  # both in the step: a round starts
    late = make_request(list(range(900, 905)), "late", max_tokens=2)
    driver.add(late)
    driver.step()  # the empty step
    out, _ = driver.step(fail_if={"r1"})
    assert set(out.num_scheduled_tokens) == {"r1"}  # the probe only; "late" waits
    assert driver.finish_reason("r1") == FinishReason.ERROR
    assert late.status == RequestStatus.WAITING
    sched.finish_requests("r2", RequestStatus.FINISHED_ABORTED)  # the last suspect
    assert not sched.is_isolating
    driver.run()
    assert driver.tokens("late") == [TOKEN] * 2


def test_requests_failing_only_together_count_against_the_engine(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    driver = make_driver()
    sched = driver.scheduler
    driver.add(*_requests(make_request, 3, max_tokens=8))

    def together(ids: set[str]) -> bool:
        return {"r1", "r2"} <= ids

    counts = []
    for _ in range(20):
        driver.step(fail_if=together)
        counts.append(sched.consecutive_unattributed_failures)
        if counts[-1] == 3:
            break
    # Each round reran everyone alone without a failure: no culprit, so each counts.
    assert counts[-1] == 3 and sorted(counts) == counts
    # A step that succeeds outside a round clears the count.
    sched.finish_requests("r2", RequestStatus.FINISHED_ABORTED)
    while sched.is_isolating:
        driver.step(fail_if=together)
    driver.step(fail_if=together)
    assert sched.consecutive_unattributed_failures == 0
    driver.run()
    assert driver.finish_reason("r1") == driver.finish_reason("r3") == FinishReason.LENGTH


def test_a_culprit_that_fails_only_when_it_samples_is_found_across_chunked_prefills(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    # A token budget of 8 splits each 12-token prompt over two steps; like a logits
    # processor, the culprit breaks a step only once it samples. A probe member is cleared
    # only after it sampled, so partial prefills neither clear nor blame anyone.
    driver = make_driver(max_num_batched_tokens=8)
    sched = driver.scheduler
    requests = [
        make_request(list(range(100 * i, 100 * i + 12)), f"r{i}", max_tokens=3) for i in range(1, 4)
    ]
    driver.add(*requests)

    def samples_r2(ids: set[str]) -> bool:
        r2 = sched.requests.get("r2")
        return "r2" in ids and r2 is not None and r2.num_computed_tokens >= r2.num_tokens

    for _ in range(60):
        if not sched.has_requests():
            break
        driver.step(fail_if=samples_r2)
    assert driver.finish_reason("r2") == FinishReason.ERROR
    for rid in ("r1", "r3"):
        assert driver.finish_reason(rid) == FinishReason.LENGTH
        assert driver.tokens(rid) == [TOKEN] * 3
    assert sched.consecutive_unattributed_failures == 0


def test_a_step_failing_inside_update_from_output_loses_no_output(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    # update_from_output raises after its per-request updates (outside any one request's
    # guard), after it has finished r1 (one token) and appended r2's and r3's tokens, and
    # after schedule() ended a prompt too long for the context. None of that was reported.
    driver = make_driver()
    sched = driver.scheduler
    r1 = make_request(list(range(100, 106)), "r1", max_tokens=1)
    r2 = make_request(list(range(200, 207)), "r2", max_tokens=3)  # its token fills block 2
    r3 = make_request(list(range(300, 306)), "r3", max_tokens=3)
    too_long = make_request(list(range(1000, 1300)), "too-long")
    driver.add(r1, r2, r3, too_long)
    out = sched.schedule()
    driver._apply_diffs(out)
    assert list(out.num_scheduled_tokens) == ["r1", "r2", "r3"]
    runner_output = ModelRunnerOutput(
        req_ids=["r1", "r2", "r3"],
        req_id_to_index={"r1": 0, "r2": 1, "r3": 2},
        sampled_token_ids=[[TOKEN], [TOKEN], [TOKEN]],
    )
    with pytest.raises(IndexError), fail_once(sched.isolator, "step_succeeded", IndexError):
        sched.update_from_output(out, runner_output)
    outputs = sched.isolate_failed_step(out, "IndexError: list index out of range")
    # The lost final outputs come out as errors: r1's (it finished) and too-long's.
    assert sorted((o.request_id, o.finish_reason) for o in outputs) == [
        ("r1", FinishReason.ERROR),
        ("too-long", FinishReason.ERROR),
    ]
    # r2's unreported token is dropped; the rerun samples it again.
    assert r2.output_token_ids == [] and r2.num_tokens == 7
    assert len(r2.block_hashes) == 1  # the hash of the block it had filled is gone too
    sched.check_integrity()
    driver.run()
    assert driver.tokens("r2") == driver.tokens("r3") == [TOKEN] * 3
    assert sched.consecutive_unattributed_failures == 0  # a good step came after the round


def test_an_update_failing_for_one_request_ends_it_alone(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    # The runner output lacks r3's row: applying r3's share raises inside its guard.
    driver = make_driver()
    sched = driver.scheduler
    r1 = make_request(list(range(100, 106)), "r1", max_tokens=1)
    r2 = make_request(list(range(200, 207)), "r2", max_tokens=3)
    r3 = make_request(list(range(300, 306)), "r3", max_tokens=3)
    driver.add(r1, r2, r3)
    out = driver.schedule()
    broken = ModelRunnerOutput(
        req_ids=["r1", "r2", "r3"],
        req_id_to_index={"r1": 0, "r2": 1, "r3": 2},
        sampled_token_ids=[[TOKEN], [TOKEN]],
    )
    outputs = sched.update_from_output(out, broken)
    by_id = {o.request_id: o for o in outputs.outputs}
    assert by_id["r1"].finish_reason == FinishReason.LENGTH
    assert by_id["r1"].new_token_ids == [TOKEN]
    assert by_id["r2"].finish_reason is None and by_id["r2"].new_token_ids == [TOKEN]
    assert by_id["r3"].finish_reason == FinishReason.ERROR
    assert by_id["r3"].error is not None and by_id["r3"].error.startswith("IndexError")
    sched.check_integrity()
    assert not sched.is_isolating and sched.consecutive_unattributed_failures == 0
    driver.run()
    assert r2.output_token_ids == [TOKEN] * 3


def test_a_schedule_failing_for_one_request_ends_it_alone(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    # A collaborator raises while the scheduler looks at r2 (a fault injected into the
    # encoder planner's per-request check): r2 ends with the error, the others run on.
    driver = make_driver()
    sched = driver.scheduler
    r1, r2, r3 = (make_request(list(range(100 * i, 100 * i + 6)), f"r{i}") for i in (1, 2, 3))
    driver.add(r1, r2, r3)
    real = sched.encoder.try_schedule

    def faulty(request: Request, *args: Any) -> tuple[list[int], int, int]:
        if request.request_id == "r2":
            raise RuntimeError("an injected fault")
        return real(request, *args)

    sched.encoder.try_schedule = faulty  # type: ignore[method-assign]
    out, outputs = driver.step()
    assert set(out.num_scheduled_tokens) == {"r1", "r3"}
    errors = [o for o in outputs.outputs if o.finish_reason == FinishReason.ERROR]
    assert [(o.request_id, o.error) for o in errors] == [("r2", "RuntimeError: an injected fault")]
    sched.check_integrity()
    # Fails in a running request's turn too: a later step ends r3 alone.
    real_for_r3 = real

    def faulty_r3(request: Request, *args: Any) -> tuple[list[int], int, int]:
        if request.request_id == "r3":
            raise RuntimeError("another fault")
        return real_for_r3(request, *args)

    sched.encoder.try_schedule = faulty_r3  # type: ignore[method-assign]
    out, outputs = driver.step()
    assert set(out.num_scheduled_tokens) == {"r1"}
    assert [o.request_id for o in outputs.outputs if o.error] == ["r3"]
    sched.check_integrity()
    sched.encoder.try_schedule = real  # type: ignore[method-assign]
    driver.run()
    assert driver.tokens("r1") == [TOKEN] * r1.max_tokens
    pool = sched.kv_cache_manager.block_pool
    assert not sched.requests and pool.get_num_free_blocks() == pool.num_blocks - 1


@contextmanager
def fail_once(obj: Any, name: str, error: type[Exception]) -> Iterator[None]:
    """Makes ``obj.name`` raise ``error`` on its next call, then behave again."""
    real = getattr(obj, name)

    def raising(*args: Any, **kwargs: Any) -> Any:
        setattr(obj, name, real)
        raise error("an injected fault")

    setattr(obj, name, raising)
    try:
        yield
    finally:
        setattr(obj, name, real)


# ---- the FailureIsolator alone: its judgements, without a scheduler ---------------------


def test_a_lone_request_is_the_culprit_and_a_round_halves_its_suspects() -> None:
    isolator = FailureIsolator()
    assert isolator.step_failed(["solo"]) == "solo"
    assert isolator.consecutive_unattributed_failures == 0 and not isolator.is_isolating
    assert isolator.step_failed(["a", "b", "c", "d"]) is None
    assert isolator.is_isolating and isolator.consecutive_unattributed_failures == 1
    assert isolator.take_flush() == {"a", "b", "c", "d"} and isolator.take_flush() is None
    assert isolator.probe() == {"a", "b"}
    isolator.cleared(["a", "b"])  # the first half is innocent
    assert isolator.probe() == {"c"}  # the first half of the remaining suspects
    assert isolator.step_failed(["c"]) == "c"  # the round found its culprit
    assert isolator.consecutive_unattributed_failures == 0
    isolator.forget("c")  # ended with the error
    assert isolator.probe() == {"d"}
    isolator.cleared(["d"])
    assert not isolator.is_isolating and isolator.probe() is None
    isolator.check_integrity([], [])


def test_unattributed_failures_in_a_row_break_the_engine() -> None:
    isolator = FailureIsolator()
    for _ in range(MAX_UNATTRIBUTED_STEP_FAILURES - 1):
        assert isolator.step_failed([]) is None
    assert not isolator.engine_is_broken
    isolator.step_succeeded()  # a good step in between resets it
    assert isolator.consecutive_unattributed_failures == 0
    for _ in range(MAX_UNATTRIBUTED_STEP_FAILURES):
        isolator.step_failed([])
    assert isolator.engine_is_broken


def test_an_abandoned_round_counts_and_idle_suspects_wait() -> None:
    isolator = FailureIsolator()
    isolator.step_failed(["a", "b", "c"])
    assert isolator.idle_suspects(["a", "x", "c"]) == {"a", "c"}
    isolator.abandon()
    assert not isolator.is_isolating and isolator.consecutive_unattributed_failures == 1
    assert isolator.take_flush() is None
