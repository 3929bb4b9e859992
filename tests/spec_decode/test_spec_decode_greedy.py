"""Greedy speculative decoding is lossless: with n-gram prompt lookup, suffix decoding and
with the model's own int8-activation copy as the draft, LLM.generate returns the
non-speculative engine's greedy tokens, which tests/entrypoints/test_llm_correctness.py pins to HF transformers
(batched and one at a time, with prefix caching and chunked prefill, under preemption),
and no KV block leaks."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvserve.sampling_params import SamplingParams
from tests.prompts import all_prompt_ids
from tests.reference import assert_no_leak

pytestmark = pytest.mark.slow
NUM_TOKENS = 24

SPEC_CONFIGS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    # Suffix decoding: the second pass below also drafts from the first pass's outputs.
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
    "quantized-draft": {
        "method": "draft_model",
        "num_speculative_tokens": 3,
        "quantization": "gguf_int8",
    },
}


def run(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def spec_stats(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler.spec_decode.spec_decoding_stats


@pytest.fixture(scope="module")
def cases(llm: Any) -> tuple[list[list[int]], list[list[int]]]:
    prompts = all_prompt_ids(llm.get_tokenizer())
    # Plus one that repeats itself, so the n-gram proposer surely drafts and gets accepted.
    repeat = llm.get_tokenizer().encode("one two three four five six. " * 6 + "one two")
    prompts = [*prompts, list(repeat)]
    return prompts, run(llm, prompts)


def lossless_engine(llm_factory: Any, method: str) -> Any:
    # Chunks of 64 tokens: the long prompts prefill over several steps.
    return llm_factory(
        speculative_config=json.dumps(SPEC_CONFIGS[method]), max_num_batched_tokens=64
    )


@pytest.mark.parametrize("method", list(SPEC_CONFIGS))
def test_greedy_is_lossless(llm_factory: Any, cases: Any, method: str) -> None:
    prompts, expected = cases
    assert len(prompts) >= 8
    engine = lossless_engine(llm_factory, method)
    assert run(engine, prompts) == expected
    # Again: the prompts now hit the prefix cache; drafts must never have been cached.
    assert run(engine, prompts) == expected
    # One at a time (no batching): a short, a long and the repeating prompt.
    for i in (1, max(range(len(prompts)), key=lambda i: len(prompts[i])), len(prompts) - 1):
        assert run(engine, [prompts[i]]) == [expected[i]]
    stats = spec_stats(engine)
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert_no_leak(engine)


@pytest.mark.parametrize("method", list(SPEC_CONFIGS))
def test_greedy_is_lossless_under_preemption(llm_factory: Any, cases: Any, method: str) -> None:
    prompts, expected = cases
    short = [i for i, p in enumerate(prompts) if len(p) < 100]
    engine = llm_factory(
        speculative_config=json.dumps(SPEC_CONFIGS[method]),
        num_blocks_override=15,
        max_num_batched_tokens=64,
    )
    scheduler = engine.llm_engine.engine_core.engine_core.scheduler
    before = scheduler.num_preemptions
    assert run(engine, [prompts[i] for i in short]) == [expected[i] for i in short]
    assert scheduler.num_preemptions > before
    assert_no_leak(engine)


def test_constrained_requests_beside_speculation(llm: Any, llm_factory: Any) -> None:
    """In a speculative engine a request under a grammar drafts what its matcher accepts,
    every draft position masked with the grammar's state after the drafts before it, and
    gives the non-speculative engine's tokens; a plain request beside it keeps its tokens."""
    from kvserve.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    constrained = SamplingParams(
        temperature=0.0, max_tokens=24,
        structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
    )  # fmt: skip
    plain = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    repeat = "one two three four five six. " * 6 + "one two"
    # The JSON prompt repeats its answer's shape, so prompt lookup drafts inside the grammar.
    prompts = ['{"n":1} {"n":2} {"n":3} {"n":1} {"n":2} A number as JSON:', repeat]
    # test_greedy_is_lossless[ngram]'s engine (its 64-token steps split the two prompts'
    # prefill): its stats count from what it has accepted so far.
    engine = lossless_engine(llm_factory, "ngram")
    accepted_before = spec_stats(engine).num_accepted_tokens
    expected = [
        o.outputs[0].token_ids for o in llm.generate(prompts, [constrained, plain], use_tqdm=False)
    ]
    got = engine.generate(prompts, [constrained, plain], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == expected
    assert isinstance(json.loads(got[0].outputs[0].text)["n"], int)
    assert spec_stats(engine).num_accepted_tokens > accepted_before
    drafts_before = spec_stats(engine).num_drafts
    [alone] = engine.generate(prompts[:1], constrained, use_tqdm=False)
    assert alone.outputs[0].token_ids == expected[0]
    assert spec_stats(engine).num_drafts > drafts_before  # the constrained one drafted
    assert_no_leak(engine)


def test_n_greater_than_one_and_a_kv_connector_beside_speculation(
    llm: Any, llm_factory: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """n > 1 (greedy children) and the SharedStorage connector under speculation: a second
    request loads the first one's KV from storage, and every output is the plain engine's."""
    from tests.distributed.kv_transfer.helpers import as_json, shared_storage

    repeat = "red green blue yellow, " * 8 + "red green"
    prompts = [repeat, "The history of Rome"]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, n=2)
    expected = [
        [c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)
    ]
    assert all(a == b for a, b in expected)
    engine = llm_factory(
        speculative_config=json.dumps(SPEC_CONFIGS["ngram"]),
        kv_transfer_config=as_json(shared_storage(tmp_path_factory.mktemp("spec_kv"))),
    )
    first = engine.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in first] == expected
    engine.reset_prefix_cache()  # the second pass must load from storage, not the cache
    again = engine.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in again] == expected
    assert again[0].num_cached_tokens > 0
    assert spec_stats(engine).num_accepted_tokens > 0
    assert_no_leak(engine)
