"""A model step that raises is blamed on the one request it is due to, found by bisection.

The failures are real: a user's logits processor plugin with a bug (faulty_logits_
processors.py), loaded by the engine as any plugin is and turned on per request through
SamplingParams.extra_args, raises inside the step of the real default model. The request
that turned it on ends with finish reason "error"; every other request of the batch
completes with exactly the tokens it produces in a batch without the bad one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from kvserve.core.sched.failure_isolator import MAX_UNATTRIBUTED_STEP_FAILURES
from kvserve.engine_core.core import EngineCore
from kvserve.protocol.engine_core import EngineCoreOutput, FinishReason
from kvserve.sampling_params import SamplingParams
from tests.engine_core.faulty_logits_processors import EXCLUSIVE_SLOT, FORCE_TOKEN
from tests.engine_core.test_core_proc import make_request
from tests.reference import assert_no_leak

# Six prompts of different lengths (some share a first block, for prefix-cache hits).
PROMPTS = [
    list(range(1000, 1016)) + list(range(2000 + 50 * i, 2005 + 50 * i + 3 * i)) for i in range(6)
]
MAX_TOKENS = 6
BAD_TOKEN_ID = 10**6  # past the vocabulary: the plugin indexes the logits with it


@pytest.fixture(scope="module")
def llm(llm_factory: Callable[..., Any]) -> Any:
    return llm_factory(logits_processors=(FORCE_TOKEN, EXCLUSIVE_SLOT))


@pytest.fixture(scope="module")
def clean(llm: Any) -> list[list[int]]:
    """Each prompt's greedy tokens from a batch with no plugin turned on."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy(), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _greedy(**extra_args: Any) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, extra_args=extra_args or None
    )


def _core(llm: Any) -> EngineCore:
    core: EngineCore = llm.llm_engine.engine_core.engine_core
    return core


@pytest.mark.parametrize("bad", [{4}, {0, 3}], ids=["one-culprit", "two-culprits"])
def test_only_the_request_that_breaks_the_step_fails(
    llm: Any, clean: list[list[int]], bad: set[int]
) -> None:
    # Request 1 uses the same plugin correctly (a token inside the vocabulary): it must
    # keep getting it through the preemptions and reruns.
    forced = 1
    params = [
        _greedy(force_token_id=BAD_TOKEN_ID)
        if i in bad
        else _greedy(force_token_id=42)
        if i == forced
        else _greedy()
        for i in range(len(PROMPTS))
    ]
    core = _core(llm)
    preemptions = core.scheduler.num_preemptions
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for i, output in enumerate(outputs):
        completion = output.outputs[0]
        if i in bad:
            assert completion.finish_reason == "error"
            assert completion.error is not None and "IndexError" in completion.error
            assert list(completion.token_ids) == []
        else:
            assert completion.finish_reason == "length", (i, completion.error)
            expected = [42] * MAX_TOKENS if i == forced else clean[i]
            assert list(completion.token_ids) == expected, i
    # The bisection went through preemption, and it is over.
    assert core.scheduler.num_preemptions > preemptions
    assert not core.scheduler.is_isolating
    assert core.scheduler.consecutive_unattributed_failures == 0
    core.scheduler.check_integrity()
    assert_no_leak(llm)
    # The engine keeps serving, with the same results.
    again = llm.generate([{"prompt_token_ids": PROMPTS[2]}], _greedy(), use_tqdm=False)
    assert list(again[0].outputs[0].token_ids) == clean[2]
    assert_no_leak(llm)


def _run(core: EngineCore, ids: set[str], max_steps: int = 100) -> dict[str, EngineCoreOutput]:
    """Steps the core, checking the scheduler's invariants after every step."""
    finals: dict[str, EngineCoreOutput] = {}
    for _ in range(max_steps):
        outputs, _ = core.step()
        core.scheduler.check_integrity()
        finals.update({o.request_id: o for o in outputs.outputs if o.finished})
        if ids <= finals.keys():
            return finals
    raise AssertionError(f"unfinished after {max_steps} steps: {ids - finals.keys()}")


def _add(core: EngineCore, request_id: str, prompt: list[int], params: SamplingParams) -> None:
    request = make_request(request_id, MAX_TOKENS, prompt)
    core.add_request(msgspec.structs.replace(request, sampling_params=params))


def test_bisection_keeps_the_scheduler_consistent_at_every_step(
    llm: Any, clean: list[list[int]]
) -> None:
    core = _core(llm)
    free = core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    ids = {f"iso-{i}" for i in range(4)}
    for i in range(4):
        params = _greedy(force_token_id=BAD_TOKEN_ID) if i == 2 else _greedy()
        _add(core, f"iso-{i}", PROMPTS[i], params)
    finals = _run(core, ids)
    assert finals["iso-2"].finish_reason == FinishReason.ERROR
    for i in (0, 1, 3):
        assert finals[f"iso-{i}"].finish_reason == FinishReason.LENGTH
    assert core.scheduler.get_num_unfinished_requests() == 0
    assert core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free


def test_failures_no_request_can_be_blamed_for_end_the_core(llm: Any) -> None:
    # Two requests that ask for the same slot break the plugin only together: each runs
    # fine alone, so no culprit is ever found. After MAX_UNATTRIBUTED_STEP_FAILURES such
    # rounds with no good step between them the core raises (its process dies, which the
    # server reports) instead of looping forever.
    core = _core(llm)
    free = core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    _add(core, "slot-a", PROMPTS[0], _greedy(slot=7))
    _add(core, "slot-b", PROMPTS[1], _greedy(slot=7))
    _add(core, "bystander", PROMPTS[2], _greedy())
    rounds = []
    with pytest.raises(RuntimeError, match="slot clash"):
        for _ in range(100):
            core.step()
            core.scheduler.check_integrity()
            rounds.append(core.scheduler.consecutive_unattributed_failures)
    assert max(rounds) == MAX_UNATTRIBUTED_STEP_FAILURES - 1
    # Left as found for the session's other tests.
    core.abort_requests(["slot-a", "slot-b", "bystander"])
    core.scheduler.isolator.consecutive_unattributed_failures = 0
    core.step()  # tells the worker they are gone
    core.scheduler.check_integrity()
    assert core.scheduler.get_num_unfinished_requests() == 0
    assert core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free


def test_a_scheduler_fault_ends_only_its_request(llm: Any, clean: list[list[int]]) -> None:
    # Faults injected into the scheduler's collaborators, one per phase: the encoder
    # planner raises in schedule() for prompt 2, the grammar tracker in update_from_output
    # for prompt 4 (after its first token). Each ends its request alone with "error"; the
    # other requests complete with exactly their tokens, and the engine keeps serving.
    scheduler = _core(llm).scheduler
    encoder, grammars = scheduler.encoder, scheduler.grammars

    def faulty_try_schedule(request: Any, *args: Any) -> Any:
        if request.prompt_token_ids == PROMPTS[2]:
            raise RuntimeError("schedule fault")
        return type(encoder).try_schedule(encoder, request, *args)

    def faulty_advance(request: Any, token_id: int) -> bool:
        if request.prompt_token_ids == PROMPTS[4] and request.num_output_tokens > 1:
            raise RuntimeError("update fault")
        return type(grammars).advance(request, token_id)

    encoder.try_schedule = faulty_try_schedule  # type: ignore[method-assign]
    grammars.advance = faulty_advance  # type: ignore[method-assign]
    try:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], _greedy(), use_tqdm=False
        )
    finally:
        del encoder.try_schedule, grammars.advance  # the class's methods again
    for i, output in enumerate(outputs):
        completion = output.outputs[0]
        if i in (2, 4):
            assert completion.finish_reason == "error"
            assert completion.error == (
                "RuntimeError: schedule fault" if i == 2 else "RuntimeError: update fault"
            )
        else:
            assert completion.finish_reason == "length", (i, completion.error)
            assert list(completion.token_ids) == clean[i], i
    assert scheduler.consecutive_unattributed_failures == 0 and not scheduler.is_isolating
    scheduler.check_integrity()
    assert_no_leak(llm)
    again = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS[2:5:2]], _greedy(), use_tqdm=False
    )
    assert [list(o.outputs[0].token_ids) for o in again] == [clean[2], clean[4]]
    assert_no_leak(llm)
