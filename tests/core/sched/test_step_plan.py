"""StepPlan alone: one step's grants, a victim's undo, and the step built from them."""

from __future__ import annotations

from kvserve.core.kv_cache_manager import KVCacheBlocks
from kvserve.core.kv_cache_utils import KVCacheBlock
from kvserve.core.sched.step_plan import StepPlan, empty_step_output
from tests.core.conftest import MakeRequest

NO_BLOCKS = KVCacheBlocks(((),))


def test_grants_spend_the_budgets_and_undo_hands_them_back(make_request: MakeRequest) -> None:
    plan = StepPlan(token_budget=16, encoder_budget=10, max_reqs=2)
    a, b = make_request(8, "a"), make_request(8, "b")
    plan.running.append(a)
    plan.grant(a, 6, NO_BLOCKS, [5, 6], [0], encoder_budget=4)
    plan.new.append(b)
    plan.grant(b, 8, NO_BLOCKS, [], [], encoder_budget=4)
    assert plan.token_budget == 2 and plan.encoder_budget == 4
    assert plan.num_scheduled_tokens == {"a": 6, "b": 8} and not plan.has_room()
    assert plan.spec_tokens == {"a": [5, 6]} and plan.encoder_inputs == {"a": [0]}
    assert plan.undo(a) is True
    assert plan.token_budget == 8 and plan.num_scheduled_tokens == {"b": 8}
    assert plan.running == [] and not plan.spec_tokens and not plan.encoder_inputs
    assert plan.undo(a) is False  # nothing left to hand back
    assert plan.total_num_scheduled_tokens == 8 and plan.has_room()


def test_the_output_carries_the_plan(make_request: MakeRequest) -> None:
    plan = StepPlan(token_budget=16, encoder_budget=0, max_reqs=4)
    new, old, back = make_request(4, "new"), make_request(4, "old"), make_request(4, "back")
    for request, granted in ((new, plan.new), (old, plan.running), (back, plan.resumed)):
        granted.append(request)
        plan.grant(request, 2, KVCacheBlocks(((KVCacheBlock(7),),)), [], [], encoder_budget=0)
    victim = make_request(4, "victim")
    plan.preempted.append(victim)
    out = plan.to_output({"gone"}, (1,), ["hash"], send_new_token_ids=False)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["new"]
    assert out.scheduled_new_reqs[0].block_ids == ([7],)
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["old", "back"]
    assert cached.resumed_from_preemption == [False, True]
    assert out.total_num_scheduled_tokens == 6 and out.num_common_prefix_blocks == (1,)
    assert out.finished_req_ids == {"gone"} and out.preempted_req_ids == {"victim"}
    assert out.free_encoder_mm_hashes == ["hash"]


def test_an_empty_step_only_tells_the_workers() -> None:
    out = empty_step_output({"done"}, {"flushed"})
    assert out.total_num_scheduled_tokens == 0 and not out.num_scheduled_tokens
    assert out.finished_req_ids == {"done"} and out.preempted_req_ids == {"flushed"}
