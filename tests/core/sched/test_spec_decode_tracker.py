"""The scheduler's side of speculative decoding: drafts scheduled as tokens, rejected ones
rolled back (their slots never cached), the acceptance counted, drafts capped and dropped."""

from __future__ import annotations

from collections.abc import Callable

from kvserve.config import SpeculativeConfig
from kvserve.core.request import Request, RequestStatus
from kvserve.protocol.runner_output import ModelRunnerOutput
from kvserve.protocol.scheduler_output import SchedulerOutput
from tests.core.sched.driver import Driver

MakeRequest = Callable[..., Request]


def ngram(k: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig(method="ngram", num_speculative_tokens=k)


def step(d: Driver, sampled: dict[str, list[int]], drafts: dict[str, list[int]]) -> SchedulerOutput:
    """One step whose runner emits ``sampled`` and proposes ``drafts`` per request."""
    sched = d.scheduler
    out = sched.schedule()
    d._apply_diffs(out)
    req_ids = list(out.num_scheduled_tokens)
    runner = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[sampled.get(r, []) for r in req_ids],
        spec_token_ids=[drafts.get(r, []) for r in req_ids],
    )
    d._record(sched.update_from_output(out, runner))
    sched.check_integrity()
    return out


def test_drafts_are_scheduled_and_rejected_ones_rolled_back(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    d = make_driver(speculative_config=ngram())
    request = make_request(list(range(8)), request_id="a", max_tokens=20)
    d.add(request)
    step(d, {"a": [50]}, {"a": [51, 52, 53]})
    assert request.spec_token_ids == [51, 52, 53]

    out = step(d, {"a": [51, 60]}, {"a": [61, 62, 63]})  # one draft accepted, then 60
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.scheduled_spec_decode_tokens == {"a": [51, 52, 53]}
    assert d.tokens("a") == [50, 51, 60]
    # 8 prompt + 50 + 51 have KV; 60 is the next input. The rejected drafts' slots are
    # not cached: only the two blocks of real tokens known when the step was scheduled.
    assert request.num_computed_tokens == request.num_tokens - 1 == 10
    manager = d.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    assert manager.num_cached_block["a"] == 2
    stats = d.scheduler.spec_decode.spec_decoding_stats
    assert stats is not None
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.num_accepted_tokens_per_pos == [1, 0, 0]

    step(d, {"a": [61, 62, 63, 64]}, {})  # all accepted plus the bonus token
    assert request.num_computed_tokens == request.num_tokens - 1 == 14
    assert stats.num_accepted_tokens_per_pos == [2, 1, 1]
    assert d.scheduler.make_stats().spec_decoding_stats.num_accepted_tokens == 4


def test_drafts_are_capped_by_max_tokens_and_min_tokens(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    d = make_driver(speculative_config=ngram(4))
    a = make_request(list(range(8)), request_id="a", max_tokens=3)
    b = make_request(list(range(20, 28)), request_id="b", max_tokens=20, min_tokens=3)
    d.add(a, b)
    drafts = [12, 13, 14, 15]
    step(d, {"a": [11], "b": [11]}, {"a": drafts, "b": drafts})
    # a: 1 of 3 tokens out, the step adds one of its own: one draft fits.
    assert a.spec_token_ids == [12]
    # b: the stop-token mask lifts after 3 tokens; drafts stop short of that position.
    assert b.spec_token_ids == [12]


def test_budget_cuts_drafts_and_preemption_drops_them(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    d = make_driver(speculative_config=ngram(4), max_num_batched_tokens=3)
    a = make_request(list(range(3)), request_id="a", max_tokens=20)
    d.add(a)
    step(d, {"a": [11]}, {"a": [12, 13, 14, 15]})
    out = step(d, {"a": [12, 13, 9]}, {})
    assert out.num_scheduled_tokens == {"a": 3}
    assert out.scheduled_spec_decode_tokens == {"a": [12, 13]}
    assert a.num_computed_tokens == a.num_tokens - 1
    a.spec_token_ids = [7, 7]
    d.scheduler.releaser.preempt(d.scheduler.table.running.pop())
    assert a.status == RequestStatus.PREEMPTED and a.spec_token_ids == []
