"""The Scheduler, driven step by step by hand-made ModelRunnerOutputs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvserve.core.request import Request, RequestStatus
from kvserve.protocol.engine_core import FinishReason
from kvserve.protocol.runner_output import LogprobsLists, LogprobsTensors, ModelRunnerOutput
from tests.core.sched.driver import EOS, TOKEN, Driver

MakeRequest = Callable[..., Request]


def test_budget_is_shared_and_prefills_are_chunked(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    d = make_driver(max_num_batched_tokens=10)
    a, b, c = (
        make_request(list(range(i * 10, i * 10 + 8)), request_id=x, max_tokens=3)
        for i, x in enumerate("abc")
    )
    d.add(a, b, c)
    out, eco = d.step()
    assert out.num_scheduled_tokens == {"a": 8, "b": 2}
    assert [o.request_id for o in eco.outputs] == ["a"]  # b's chunk is partial: silent
    out, _ = d.step()
    assert out.num_scheduled_tokens == {"a": 1, "b": 6, "c": 3}
    assert [n.req_id for n in out.scheduled_new_reqs] == ["c"]
    assert out.scheduled_cached_reqs.req_ids == ["a", "b"]
    assert out.scheduled_cached_reqs.num_computed_tokens == [8, 2]
    d.run()
    for rid in "abc":
        assert d.tokens(rid) == [TOKEN] * 3 and d.finish_reason(rid) == FinishReason.LENGTH


def test_long_prefill_token_threshold_caps_chunks(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    d = make_driver(long_prefill_token_threshold=4)
    d.add(make_request(10, request_id="a", max_tokens=2))
    steps = [d.step() for _ in range(4)]
    assert [o.num_scheduled_tokens["a"] for o, _ in steps] == [4, 4, 2, 1]
    assert [len(e.outputs) for _, e in steps] == [0, 0, 1, 1]
    assert d.finish_reason("a") == FinishReason.LENGTH


def test_max_num_seqs_limits_running_requests(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    d = make_driver(max_num_seqs=2)
    d.add(*(make_request(4, request_id=x, max_tokens=2) for x in "abc"))
    out, _ = d.step()
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    out, _ = d.step()  # a and b finish in this step
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    out, _ = d.step()
    assert set(out.num_scheduled_tokens) == {"c"} and out.finished_req_ids == {"a", "b"}
    d.run()


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_waiting_order_follows_the_policy(
    policy: str, make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    d = make_driver(max_num_seqs=1, policy=policy)
    d.add(
        make_request(4, request_id="lazy", priority=5, max_tokens=1),
        make_request(4, request_id="urgent", priority=0, max_tokens=1),
    )
    first, _ = d.step()
    expected = "lazy" if policy == "fcfs" else "urgent"
    assert list(first.num_scheduled_tokens) == [expected]
    d.run()


def test_waiting_request_never_preempts_a_running_one(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    d = make_driver(num_blocks=4, policy="priority")  # 3 usable blocks
    d.add(make_request(8, request_id="lazy", priority=9, max_tokens=3))
    d.step()
    d.add(make_request(8, request_id="urgent", priority=0, max_tokens=1))
    out, _ = d.step()
    assert list(out.num_scheduled_tokens) == ["lazy"] and not out.preempted_req_ids
    d.run()
    assert d.finish_reason("urgent") == FinishReason.LENGTH


def test_preemption_and_resumption_fcfs(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    d = make_driver(num_blocks=5)  # 4 usable blocks: two 7-token prompts fill them
    d.add(
        make_request(7, request_id="a", max_tokens=4),
        make_request(list(range(50, 57)), request_id="b", max_tokens=4),
    )
    d.step()
    d.step()  # both reach 8 tokens: still 2 blocks each
    out, _ = d.step()  # a needs a 3rd block: the last running request is the victim
    assert out.preempted_req_ids == {"b"} and list(out.num_scheduled_tokens) == ["a"]
    b = d.scheduler.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and d.scheduler.num_preemptions == 1
    resumed_at = None
    for _ in range(10):
        out, _ = d.step()
        if "b" in out.scheduled_cached_reqs.req_ids:
            resumed_at = out.scheduled_cached_reqs.req_ids.index("b")
            break
    assert resumed_at is not None, "b never resumed"
    cached = out.scheduled_cached_reqs
    assert cached.resumed_from_preemption[resumed_at]
    assert cached.new_block_ids[resumed_at] == tuple(
        d.scheduler.kv_cache_manager.get_block_ids("b")
    )
    assert not out.scheduled_new_reqs  # a resumed request is not new to the workers
    d.run()
    assert d.tokens("a") == [TOKEN] * 4 and d.tokens("b") == [TOKEN] * 4
    stats = d.scheduler.make_stats()
    assert stats is not None and stats.num_preemptions == 1


def test_batch_queue_never_runs_a_request_in_two_batches(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    """Two micro-batches in flight: each takes its share of the requests, one in flight is
    never scheduled again, and one preempted in flight does not take its batch's token."""
    d = make_driver(num_blocks=5, max_concurrent_batches=2)  # 4 usable blocks
    sched = d.scheduler
    d.add(
        make_request(7, request_id="a", max_tokens=4),
        make_request(list(range(50, 57)), request_id="b", max_tokens=4),
    )
    first, second = d.schedule(), d.schedule()
    assert list(first.num_scheduled_tokens) == ["a"] and list(second.num_scheduled_tokens) == ["b"]
    assert d.schedule().total_num_scheduled_tokens == 0  # both in flight
    assert sched.batches.in_flight == {"a", "b"}
    sched.check_integrity()
    d.update(first)
    d.update(d.schedule())  # a has 9 tokens: its next one needs a 3rd block
    third = d.schedule()  # so b, still in flight, is preempted
    assert third.preempted_req_ids == {"b"} and list(third.num_scheduled_tokens) == ["a"]
    assert d.schedule().total_num_scheduled_tokens == 0  # b waits for its batch
    # The token b's batch sampled (its prompt was done) is dropped: b recomputes it.
    sampled = ModelRunnerOutput(req_ids=["b"], req_id_to_index={"b": 0}, sampled_token_ids=[[9]])
    assert not sched.update_from_output(second, sampled).outputs
    assert sched.batches.in_flight == {"a"}
    sched.check_integrity()
    d.update(third)
    d.run()
    assert d.tokens("a") == [TOKEN] * 4 and d.tokens("b") == [TOKEN] * 4


def test_priority_preemption_picks_the_least_urgent(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    d = make_driver(num_blocks=7, policy="priority")  # 6 usable blocks
    d.add(
        make_request(7, request_id="mid", priority=1, max_tokens=4),
        make_request(list(range(50, 57)), request_id="lazy", priority=5, max_tokens=4),
        make_request(list(range(60, 67)), request_id="top", priority=0, max_tokens=4),
    )
    d.step()
    d.step()
    out, _ = d.step()  # every request needs a 3rd block; only "lazy" has to go
    assert out.preempted_req_ids == {"lazy"}
    assert set(out.num_scheduled_tokens) == {"mid", "top"}
    d.run()
    assert all(d.tokens(r) == [TOKEN] * 4 for r in ("mid", "lazy", "top"))


def test_stop_conditions_through_the_scheduler(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    d = make_driver(max_model_len=12)
    d.add(
        make_request(4, request_id="eos"),
        make_request(4, request_id="ignore", ignore_eos=True, max_tokens=2),
        make_request(4, request_id="min", min_tokens=2),
        make_request(4, request_id="stop", stop_token_ids=[EOS, 40]),
        make_request(10, request_id="len", max_tokens=100),
    )
    d.step(tokens={"eos": EOS, "ignore": EOS, "min": EOS, "stop": EOS})
    d.step(tokens={"ignore": EOS, "min": EOS})
    assert d.tokens("eos") == [EOS] and d.finish_reason("eos") == FinishReason.STOP
    assert d.outputs["eos"][-1].stop_reason is None
    assert d.tokens("ignore") == [EOS, EOS] and d.finish_reason("ignore") == FinishReason.LENGTH
    assert d.tokens("min") == [EOS, EOS] and d.finish_reason("min") == FinishReason.STOP
    # eos is stop_token_ids' member too, but eos is checked first: no stop_reason.
    assert d.finish_reason("stop") == FinishReason.STOP
    assert d.tokens("len") == [TOKEN, TOKEN] and d.finish_reason("len") == FinishReason.LENGTH
    d.run()


def test_stop_token_id_reports_stop_reason(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    d = make_driver()
    d.add(make_request(4, request_id="a", stop_token_ids=[40]))
    d.step(tokens={"a": 40})
    assert d.outputs["a"][-1].stop_reason == 40 and d.finish_reason("a") == FinishReason.STOP


def test_abort_frees_blocks_and_is_reported_once(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    d = make_driver(max_num_seqs=1)
    d.add(make_request(9, request_id="run"), make_request(9, request_id="wait"))
    d.step()
    pool = d.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() < pool.num_blocks - 1
    d.scheduler.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    d.scheduler.finish_requests("run", RequestStatus.FINISHED_ABORTED)  # twice: ignored
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    assert d.scheduler.get_num_unfinished_requests() == 0
    assert d.scheduler.has_finished_requests() and d.scheduler.has_requests()
    out, eco = d.step()
    assert out.finished_req_ids == {"run", "wait"} and eco.outputs == []
    assert not d.scheduler.has_requests()


def test_request_that_can_never_fit_finishes_with_an_error(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    d = make_driver(num_blocks=4, max_model_len=32)  # 3 usable blocks: 12 tokens
    d.add(
        make_request(13, request_id="huge"),
        make_request(40, request_id="too_long"),
        make_request(4, request_id="ok", max_tokens=2),
    )
    out, eco = d.step()
    assert list(out.num_scheduled_tokens) == ["ok"]
    errors = {o.request_id: o for o in eco.outputs if o.finish_reason == FinishReason.ERROR}
    assert set(errors) == {"huge", "too_long"}
    assert "blocks" in (errors["huge"].error or "") and "max_model_len" in (
        errors["too_long"].error or ""
    )
    d.run()
    assert d.tokens("ok") == [TOKEN, TOKEN]


def test_decode_outgrowing_the_pool_ends_with_an_error(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    d = make_driver(num_blocks=3)  # 2 usable blocks: 8 tokens
    d.add(make_request(6, request_id="a", max_tokens=10))
    d.run()
    assert d.tokens("a") == [TOKEN] * 3 and d.finish_reason("a") == FinishReason.ERROR


def test_prefix_hits_skip_computation(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    d = make_driver()
    d.add(make_request(list(range(10)), request_id="first", max_tokens=1))
    d.run()
    d.add(make_request(list(range(10)), request_id="again", max_tokens=1))
    out, eco = d.step()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8
    assert out.num_scheduled_tokens == {"again": 2}
    assert eco.outputs[0].num_cached_tokens == 8
    assert eco.scheduler_stats is not None and eco.scheduler_stats.prefix_cache_hits == 8
    d.run()


def test_common_prefix_blocks_of_running_requests(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    d = make_driver()
    d.add(make_request(list(range(9)), request_id="a"))
    d.step()
    d.add(make_request([*range(8), 77], request_id="b"))
    out, _ = d.step()
    assert out.num_common_prefix_blocks == (2,)


def test_chunked_prefill_disabled_waits_for_budget(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    d = make_driver(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False)
    d.add(make_request(12, request_id="a", max_tokens=3))
    d.step()
    d.add(
        make_request(list(range(50, 66)), request_id="big", max_tokens=1),
        make_request(list(range(70, 74)), request_id="small", max_tokens=1),
    )
    out, _ = d.step()  # a's decode takes 1 token: 15 left, big (16) waits, small goes
    assert out.num_scheduled_tokens == {"a": 1, "small": 4}
    assert d.scheduler.waiting.peek_request().request_id == "big"
    d.run()
    assert d.tokens("big") == [TOKEN]


def test_logprobs_and_prompt_logprobs_reach_the_outputs(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    d = make_driver()
    d.add(
        make_request(4, request_id="plain", max_tokens=1),
        make_request(4, request_id="lp", max_tokens=1, logprobs=1, prompt_logprobs=1),
    )
    logprobs = LogprobsLists([[7, 3], [7, 5]], [[-0.1, -2.0], [-0.2, -3.0]], [1, 1])
    prompt = LogprobsTensors(torch.tensor([[1, 2]] * 3), torch.zeros(3, 2), torch.ones(3))
    d.step(logprobs=logprobs, prompt_logprobs_dict={"lp": prompt, "plain": None})
    lp, plain = d.outputs["lp"][0], d.outputs["plain"][0]
    assert lp.new_logprobs_token_ids == [[7, 5]] and lp.new_logprobs == [[-0.2, -3.0]]
    assert lp.new_sampled_token_ranks == [1]
    assert lp.new_prompt_logprobs_token_ids == [[1, 2]] * 3
    assert lp.new_prompt_logprobs_ranks == [1, 1, 1]
    assert plain.new_logprobs is None and plain.new_prompt_logprobs is None


def test_partial_prefill_with_prompt_logprobs_still_reports(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    d = make_driver(long_prefill_token_threshold=4)
    d.add(make_request(8, request_id="a", max_tokens=1, prompt_logprobs=0))
    chunk = LogprobsTensors(torch.tensor([[1]] * 4), torch.zeros(4, 1), torch.ones(4))
    _, eco = d.step(prompt_logprobs_dict={"a": chunk})
    (output,) = eco.outputs
    assert output.new_token_ids == [] and output.finish_reason is None
    assert output.new_prompt_logprobs_token_ids == [[1]] * 4
    d.run()


def test_reset_prefix_cache_waits_for_free_blocks(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    d = make_driver()
    d.add(make_request(9, request_id="a", max_tokens=2))
    d.step()
    assert not d.scheduler.reset_prefix_cache()
    d.run()
    assert d.scheduler.reset_prefix_cache()
    d.add(make_request(9, request_id="b", max_tokens=1))
    out, _ = d.step()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    d.run()


def test_request_without_block_hashes_is_refused(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    d = make_driver()
    template = make_request(8)
    bare = Request("bare", list(range(8)), template.sampling_params, EOS)
    with pytest.raises(ValueError, match="block_hasher"):
        d.scheduler.add_request(bare)


def test_blocks_computed_in_this_step_are_hits_for_later_requests(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    # a's blocks become cache entries when allocated, so b (same step) reuses one of them:
    # the workers must write the whole batch's KV before any request attends to it.
    d = make_driver()
    d.add(
        make_request(list(range(8)), request_id="a", max_tokens=1),
        make_request(list(range(8)), request_id="b", max_tokens=1),
    )
    out, _ = d.step()
    assert out.num_scheduled_tokens == {"a": 8, "b": 4}
    a_blocks, b_blocks = (n.block_ids[0] for n in out.scheduled_new_reqs)
    assert b_blocks[0] == a_blocks[0] and b_blocks[1] != a_blocks[1]
    d.run()


def test_resumed_request_reuses_its_own_cached_blocks(
    make_driver: Callable[..., Driver], make_request: MakeRequest
) -> None:
    d = make_driver(num_blocks=5)
    d.add(
        make_request(7, request_id="a", max_tokens=3),
        make_request(list(range(50, 57)), request_id="b", max_tokens=4),
    )
    for _ in range(3):
        d.step()
    assert d.scheduler.requests["b"].status == RequestStatus.PREEMPTED
    assert d.finish_reason("a") == FinishReason.LENGTH  # a finished in the 3rd step
    out, _ = d.step()
    # a took the block b freed last, the tail of b's chain; b's first block is still
    # cached, so of b's 9 tokens 4 are reused and 5 recomputed.
    assert out.num_scheduled_tokens == {"b": 5}
    assert out.scheduled_cached_reqs.num_computed_tokens == [4]
    assert out.scheduled_cached_reqs.resumed_from_preemption == [True]
    d.run()
    assert d.tokens("b") == [TOKEN] * 4
