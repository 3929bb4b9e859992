"""Async scheduling (``async_scheduling=True``): step N+1 is scheduled and sent while step
N runs on the worker's thread, its requests' sampled tokens still placeholders.

On a tiny random Llama (tests/engine_core/builders.py): greedy tokens are HF's with chunked
prefill, preemption by recompute (a tiny KV cache), stop tokens, max_tokens, aborts while
in flight, stop strings (the front end's) and a step that fails (a faulty logits processor
plugin: its request alone ends); nothing comes out after a request finished, and every
block and per-request entry is given back; a served core (EngineCoreProc over ZMQ) does
the same. Speculative decoding falls back to synchronous steps, and says so.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserve.args.engine_args import EngineArgs
from kvserve.engine.mp_client import SyncMPClient
from kvserve.engine_core.core import EngineCore
from kvserve.protocol.engine_core import EngineCoreRequest, FinishReason
from kvserve.sampling_params import SamplingParams
from kvserve.utils.census import per_request_objects
from tests.engine_core.builders import tiny_engine_core, tiny_llama
from tests.engine_core.faulty_logits_processors import FORCE_TOKEN
from tests.engine_core.test_core_proc import collect, make_request, wait_idle
from tests.entrypoints.test_llm_tiny_models import hf_greedy

PROMPTS = [list(range(5, 29)), list(range(40, 47)), list(range(60, 70))]  # 24: two chunks
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    directory = tmp_path_factory.mktemp("tiny-llama-async")
    return directory, tiny_llama(directory)


OBJECTS_BEFORE: dict[str, int] = {}


@pytest.fixture(scope="module")
def core(tiny: tuple[Path, Any]) -> Iterator[EngineCore]:
    OBJECTS_BEFORE.update(per_request_objects())
    core = tiny_engine_core(tiny[0], async_scheduling=True)
    yield core
    core.shutdown()


def run(core: EngineCore, requests: list[EngineCoreRequest]) -> dict[str, list[int]]:
    """Steps until idle; every request's tokens. Fails on an output after a finish."""
    for request in requests:
        core.add_request(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    finished: set[str] = set()
    for _ in range(200):
        if not core.has_work():
            break
        outputs, _ = core.step()
        for output in outputs.outputs:
            assert output.request_id not in finished, f"{output.request_id}: output after finish"
            tokens[output.request_id] += output.new_token_ids
            if output.finished:
                finished.add(output.request_id)
    assert finished == set(tokens) and not core.has_work()
    return tokens


def assert_idle_and_clean(core: EngineCore) -> None:
    core.scheduler.check_integrity()
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    census = core.request_census()["engine_core"]
    leaks = {k: v for k, v in census.items() if v and not k.startswith("objects.")}
    assert not leaks
    # Live per-request objects are counted process-wide: other engines of the suite (the
    # session's SmolLM2 holds its last finished request until its next step) count too.
    grown = {k: v for k, v in census.items() if v > OBJECTS_BEFORE.get(k, 0)}
    assert not grown


def test_tokens_are_hfs_while_the_next_step_runs_ahead(
    core: EngineCore, tiny: tuple[Path, Any]
) -> None:
    assert core.batch_queue.size == 2
    requests = [make_request(f"r{i}", MAX_TOKENS, p) for i, p in enumerate(PROMPTS)]
    tokens = run(core, requests)
    for i, prompt in enumerate(PROMPTS):
        # max_tokens exactly: the step scheduled on the last placeholder is not taken.
        assert tokens[f"r{i}"] == hf_greedy(tiny[1], prompt, MAX_TOKENS)
    assert core.max_batches_in_flight == 2  # a step was sent before the last one came back
    assert_idle_and_clean(core)


def test_a_stop_token_ends_the_request_at_once(core: EngineCore, tiny: tuple[Path, Any]) -> None:
    greedy = hf_greedy(tiny[1], PROMPTS[1], MAX_TOKENS)
    stop_at = 3
    while greedy.index(greedy[stop_at]) != stop_at:  # its first occurrence
        stop_at += 1
    request = make_request("s0", MAX_TOKENS, PROMPTS[1])
    request.sampling_params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[greedy[stop_at]]
    )
    other = make_request("s1", MAX_TOKENS, PROMPTS[2])
    tokens = run(core, [request, other])
    assert tokens["s0"] == greedy[: stop_at + 1]
    assert tokens["s1"] == hf_greedy(tiny[1], PROMPTS[2], MAX_TOKENS)
    assert_idle_and_clean(core)


def test_an_abort_while_in_flight_takes_nothing_more(
    core: EngineCore, tiny: tuple[Path, Any]
) -> None:
    core.add_request(make_request("a0", 20, PROMPTS[1]))
    core.add_request(make_request("a1", MAX_TOKENS, PROMPTS[2]))
    produced = 0
    while produced < 3:
        outputs, _ = core.step()
        produced += sum(len(o.new_token_ids) for o in outputs.outputs if o.request_id == "a0")
    assert core.batch_queue  # a0's next step is in flight
    core.abort_requests(["a0"])
    tokens: list[int] = []
    while core.has_work():
        outputs, _ = core.step()
        assert all(o.request_id != "a0" for o in outputs.outputs)
        tokens += [t for o in outputs.outputs for t in o.new_token_ids]
    assert hf_greedy(tiny[1], PROMPTS[2], MAX_TOKENS)[-len(tokens) :] == tokens
    assert_idle_and_clean(core)


def test_preemption_by_recompute_keeps_the_tokens(tiny: tuple[Path, Any]) -> None:
    # 12 blocks of 4 tokens: three requests of 10 + 12 tokens cannot all stay.
    core = tiny_engine_core(tiny[0], async_scheduling=True, num_blocks_override=13)
    try:
        requests = [make_request(f"p{i}", 12, p) for i, p in enumerate(PROMPTS[1:] * 2)]
        tokens = run(core, requests)
        assert core.scheduler.num_preemptions > 0
        for i, prompt in enumerate(PROMPTS[1:] * 2):
            assert tokens[f"p{i}"] == hf_greedy(tiny[1], prompt, 12)
        assert_idle_and_clean(core)
    finally:
        core.shutdown()


def test_a_failing_step_is_blamed_on_its_request_alone(tiny: tuple[Path, Any]) -> None:
    # The step after the failing one was sent on its placeholders: it is void, its
    # requests recompute, and the bisection still ends only the request at fault.
    core = tiny_engine_core(tiny[0], async_scheduling=True, logits_processors=(FORCE_TOKEN,))
    try:
        bad = make_request("bad", MAX_TOKENS, PROMPTS[0])
        bad.sampling_params = SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
            extra_args={"force_token_id": 10**6},  # past the vocabulary: the plugin raises
        )  # fmt: skip
        requests = [make_request(f"ok{i}", MAX_TOKENS, p) for i, p in enumerate(PROMPTS[1:])]
        for request in [*requests, bad]:
            core.add_request(request)
        finals: dict[str, Any] = {}
        tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
        for _ in range(200):
            if not core.has_work():
                break
            for output in core.step()[0].outputs:
                assert output.request_id not in finals
                tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
                if output.finished:
                    finals[output.request_id] = output
            core.scheduler.check_integrity()
        assert finals["bad"].finish_reason == FinishReason.ERROR and not tokens["bad"]
        for i, prompt in enumerate(PROMPTS[1:]):
            assert finals[f"ok{i}"].finish_reason == FinishReason.LENGTH
            assert tokens[f"ok{i}"] == hf_greedy(tiny[1], prompt, MAX_TOKENS)
        assert core.scheduler.consecutive_unattributed_failures == 0
        assert_idle_and_clean(core)
    finally:
        core.shutdown()


def test_stop_strings_finish_exactly(tiny: tuple[Path, Any]) -> None:
    from kvserve.entrypoints.llm import LLM

    llm = LLM(
        str(tiny[0]),
        block_size=4,
        max_num_batched_tokens=16,
        kv_cache_memory=8 << 20,
        max_model_len=256,
        async_scheduling=True,
    )
    try:
        prompt: Any = {"prompt_token_ids": PROMPTS[2]}
        full = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
        assert list(full[0].outputs[0].token_ids) == hf_greedy(tiny[1], PROMPTS[2], 24)
        text = full[0].outputs[0].text
        word = text[len(text) // 2 : len(text) // 2 + 3]
        params = SamplingParams(temperature=0.0, max_tokens=24, stop=[word])
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert out.text == text[: text.index(word)] and out.finish_reason == "stop"
        core = llm.llm_engine.engine_core.engine_core
        assert core.max_batches_in_flight == 2
        # The step scheduled on the stopped request's placeholder may still be in flight:
        # it comes back with nothing for anyone.
        while core.has_work():
            assert not core.step()[0].outputs
        assert_idle_and_clean(core)
    finally:
        llm.llm_engine.shutdown()


def test_speculative_decoding_falls_back_to_synchronous_steps(
    tiny: tuple[Path, Any], caplog: pytest.LogCaptureFixture
) -> None:
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}
    args = EngineArgs(model=str(tiny[0]), async_scheduling=True, speculative_config=ngram)
    with caplog.at_level(logging.WARNING, logger="kvserve.config.engine"):
        config = args.create_engine_config()
    assert not config.scheduler_config.async_scheduling
    assert "async scheduling is not supported with speculative decoding" in caplog.text


@pytest.mark.slow
def test_a_served_core_runs_ahead_too(tiny: tuple[Path, Any]) -> None:
    # EngineCoreProc's loop sends step N's outputs to the front end while N+1 runs.
    args = dict(block_size=4, max_num_batched_tokens=16, kv_cache_memory=8 << 20)
    config = EngineArgs(model=str(tiny[0]), async_scheduling=True, **args).create_engine_config()
    client = SyncMPClient(config)
    try:
        client.add_request(make_request("m0", MAX_TOKENS, PROMPTS[0]))
        client.add_request(make_request("long", 10_000, PROMPTS[1]))
        tokens, final = collect(client, "m0")
        assert tokens == hf_greedy(tiny[1], PROMPTS[0], MAX_TOKENS)
        assert final.finish_reason == FinishReason.LENGTH
        client.abort_requests(["long"])  # in flight: its next step was sent already
        assert wait_idle(client).kv_cache_usage == 0.0
    finally:
        client.shutdown()
