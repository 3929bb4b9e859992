"""DPLoadBalancer: which data-parallel core takes a request (no processes: milliseconds)."""

from __future__ import annotations

from kvserve.engine.dp_balancer import (
    PREFIX_OVERLOAD_SLACK,
    DPLoadBalancer,
    IndexPrefixPolicy,
    NoPrefixPolicy,
)
from kvserve.protocol.engine_core import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from kvserve.protocol.kv_events import BlockStored
from kvserve.sampling_params import SamplingParams

BLOCK = 4


def _request(request_id: str, tokens: list[int]) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=1),
        eos_token_id=None,
        arrival_time=0.0,
    )


def _report(core: int, waiting: int = 0, running: int = 0, **kwargs: object) -> EngineCoreOutputs:
    stats = SchedulerStats(num_waiting_reqs=waiting, num_running_reqs=running)
    return EngineCoreOutputs(scheduler_stats=stats, engine_index=core, **kwargs)  # type: ignore[arg-type]


def test_least_loaded_weighs_queues_and_goes_round_robin_when_idle() -> None:
    balancer = DPLoadBalancer(3, NoPrefixPolicy())
    picks = []
    for i in range(6):
        request = _request(f"r{i}", [1, 2, 3])
        core = balancer.choose(request)
        balancer.assign([request.request_id], core)
        picks.append(core)
    # Requests sent but not yet reported count as waiting: the three cores take turns.
    assert picks == [0, 1, 2, 0, 1, 2]
    # Reports replace the guesses: 1 waiting (score 4) weighs more than 3 running (3).
    balancer.on_outputs(_report(0, waiting=1))
    balancer.on_outputs(_report(1, running=3))
    balancer.on_outputs(_report(2, waiting=1, running=1))
    assert balancer.choose(_request("x", [1])) == 1


def test_prefix_policy_follows_the_cores_events_unless_the_core_is_overloaded() -> None:
    policy = IndexPrefixPolicy(BLOCK, hash_seed=0)
    balancer = DPLoadBalancer(2, policy)
    prompt = list(range(10, 22))  # three full blocks
    stored = BlockStored(
        block_hashes=[bytes(h) for h in policy.index.block_hashes(prompt)],
        parent_block_hash=None,
        token_ids=prompt,
        block_size=BLOCK,
    )
    balancer.on_outputs(_report(1, kv_events=[stored]))
    balancer.on_outputs(_report(0))
    # Core 1 holds the prompt's blocks: the next turn goes there, though core 0 is idle too
    # and would come first by load.
    turn_two = _request("t2", [*prompt, 7, 7, 7, 7])
    assert balancer.choose(turn_two) == 1
    # A different prompt matches nothing: by load (round robin from core 0).
    assert balancer.choose(_request("other", [99, 98, 97, 96])) == 0
    # Core 1 far busier than core 0: the hit is not worth the queue.
    balancer.on_outputs(_report(1, waiting=PREFIX_OVERLOAD_SLACK + 1))
    assert balancer.choose(turn_two) == 0


def test_owners_route_aborts_and_a_dead_core_hands_back_its_requests() -> None:
    balancer = DPLoadBalancer(2, NoPrefixPolicy())
    balancer.assign(["a", "b"], 0)
    balancer.assign(["c"], 1)
    balancer.assign(["d"], 1)
    assert balancer.by_owner(["a", "c", "unknown"]) == {0: ["a"], 1: ["c"]}
    finished = EngineCoreOutput(request_id="b", new_token_ids=[], finish_reason=FinishReason.STOP)
    balancer.on_outputs(EngineCoreOutputs(outputs=[finished], engine_index=0))
    assert balancer.owner == {"d": 1}
    assert balancer.mark_dead(1) == ["d"]
    assert balancer.alive == [0] and balancer.choose(_request("e", [1])) == 0
