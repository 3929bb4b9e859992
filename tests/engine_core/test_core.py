"""EngineCore isolates failures: a request it cannot run, or a step that raises, fails only
that request; the core keeps serving and no KV block leaks (test_core_isolation.py has the
bisection over a batch, driven by a faulty logits processor plugin).

The requests here go straight to the core, past the front door's validation, as a client
speaking the core's wire protocol could send them; the model is the real default one.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvserve.core.request import Request
from kvserve.core.sched.failure_isolator import MAX_UNATTRIBUTED_STEP_FAILURES
from kvserve.engine_core.core import EngineCore
from kvserve.protocol.engine_core import EngineCoreOutput, EngineCoreRequest, FinishReason
from kvserve.sampling_params import SamplingParams
from tests.engine_core.test_core_proc import make_request

PROMPT = list(range(1000, 1020))


def _request(
    request_id: str, params: SamplingParams, prompt: list[int] = PROMPT
) -> EngineCoreRequest:
    return msgspec.structs.replace(make_request(request_id, 1, prompt), sampling_params=params)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _run(core: EngineCore, ids: set[str], max_steps: int = 200) -> dict[str, EngineCoreOutput]:
    finals: dict[str, EngineCoreOutput] = {}
    for _ in range(max_steps):
        outputs, _ = core.step()
        finals.update({o.request_id: o for o in outputs.outputs if o.finished})
        if ids <= finals.keys():
            return finals
    raise AssertionError(f"unfinished after {max_steps} steps: {ids - finals.keys()}")


@pytest.fixture
def core(llm: Any) -> EngineCore:
    engine_core: EngineCore = llm.llm_engine.engine_core.engine_core
    assert engine_core.scheduler.get_num_unfinished_requests() == 0
    return engine_core


def _free_blocks(core: EngineCore) -> int:
    return core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def test_a_prompt_outside_the_vocabulary_is_refused_alone(core: EngineCore) -> None:
    with pytest.raises(ValueError, match="prompt_token_ids contains token ids outside"):
        core.add_request(_request("bad", _greedy(2), prompt=[1, 10**9]))
    with pytest.raises(ValueError, match="outside"):
        core.add_request(_request("negative", _greedy(2), prompt=[-1]))
    core.add_request(_request("good", _greedy(3)))
    final = _run(core, {"good"})["good"]
    assert final.finish_reason == FinishReason.LENGTH


def _tokens(outputs: list[EngineCoreOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def test_a_failing_step_fails_only_the_poisoned_request(core: EngineCore) -> None:
    free = _free_blocks(core)
    core.add_request(_request("alone", _greedy(8)))
    alone = _tokens(_run_all(core, "alone"))
    # A prompt token outside the vocabulary (past add_request's check, straight into the
    # scheduler) makes the forward pass of the batch, both requests, raise. Rerun one at
    # a time, only the poisoned one fails again. (A NaN temperature did this before the
    # sampler gave undefined rows a distribution.)
    poisoned = _request("poisoned", _greedy(8), prompt=[*PROMPT[:-1], 10**9])
    core.scheduler.add_request(Request.from_engine_core_request(poisoned, core.block_hasher))
    core.add_request(_request("same-batch", _greedy(8)))
    outputs = _run_all(core, "poisoned", "same-batch")
    finals = {o.request_id: o for o in outputs if o.finished}
    assert finals["poisoned"].finish_reason == FinishReason.ERROR
    assert finals["poisoned"].error and "IndexError" in finals["poisoned"].error
    assert finals["same-batch"].finish_reason == FinishReason.LENGTH
    assert _tokens([o for o in outputs if o.request_id == "same-batch"]) == alone
    assert core.scheduler.get_num_unfinished_requests() == 0
    assert core.scheduler.consecutive_unattributed_failures == 0
    assert _free_blocks(core) == free


def _run_all(core: EngineCore, *ids: str, max_steps: int = 200) -> list[EngineCoreOutput]:
    """Every output of the requests until all finished, checking the scheduler each step."""
    outputs: list[EngineCoreOutput] = []
    finished: set[str] = set()
    for _ in range(max_steps):
        step_outputs, _ = core.step()
        core.scheduler.check_integrity()
        outputs += [o for o in step_outputs.outputs if o.request_id in ids]
        finished |= {o.request_id for o in step_outputs.outputs if o.finished}
        if finished >= set(ids):
            return outputs
    raise AssertionError(f"unfinished after {max_steps} steps: {set(ids) - finished}")


def test_a_request_failing_alone_is_blamed_however_often_it_comes(core: EngineCore) -> None:
    # Past add_request's check, straight into the scheduler: every step that runs such a
    # request fails. Alone in its step, each is its own fault, so however many come one
    # after another the core never counts them against itself and goes on serving.
    free = _free_blocks(core)
    for i in range(MAX_UNATTRIBUTED_STEP_FAILURES + 1):
        bad = _request(f"out-of-vocab-{i}", _greedy(2), prompt=[1, 10**9])
        core.scheduler.add_request(Request.from_engine_core_request(bad, core.block_hasher))
        outputs, _ = core.step()
        assert [o.finish_reason for o in outputs.outputs] == [FinishReason.ERROR]
        assert core.scheduler.consecutive_unattributed_failures == 0
    core.add_request(_request("after", _greedy(4)))
    assert _run(core, {"after"})["after"].finish_reason == FinishReason.LENGTH
    assert core.scheduler.get_num_unfinished_requests() == 0
    assert _free_blocks(core) == free
