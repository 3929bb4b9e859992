"""``LLM(..., data_parallel_size=2)``: two engine-core processes behind one front end.

On a tiny random Llama with two PEFT adapters (the LoRA tests' checkpoint), the DP engine
with LoRA and ngram speculative decoding on: greedy tokens identical to one plain core
and to HF transformers, both cores served requests (their own metrics, by the engine
label), n > 1 children stay on one core; adapters (HF + PEFT merged) and JSON-schema
structured outputs (one core's tokens) on both cores; and the prefix policy sends every
turn of a multi-turn workload to the core holding its prefix, for at least twice the
fleet's prefix hit rate of least_loaded on the same workload (the cores' own counters).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserve.entrypoints.llm import LLM
from kvserve.lora.request import LoRARequest
from kvserve.metrics.reader import Counter
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.entrypoints.test_llm_tiny_models import CORPUS
from tests.family_models import hf_greedy
from tests.lora.adapters import build_base_and_adapters, merged_reference

BLOCK_SIZE = 4
MAX_TOKENS = 6
COMMON: dict[str, Any] = dict(
    skip_tokenizer_init=True, block_size=BLOCK_SIZE, kv_cache_memory=8 << 20
)


# Features that must work across cores, on in the shared DP engine (its tokenizer too).
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
CROSS_CORE: dict[str, Any] = dict(
    enable_lora=True, max_loras=2, max_lora_rank=8, speculative_config=json.dumps(NGRAM)
)


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, dict[str, Path]]:
    directory = tmp_path_factory.mktemp("llama_dp")
    base, adapters = build_base_and_adapters(directory)
    return directory, base, adapters


@pytest.fixture(scope="module")
def checkpoint(lora_models: tuple[Path, Any, dict[str, Path]]) -> tuple[Path, Any]:
    return lora_models[0] / "base", lora_models[1]


@pytest.fixture(scope="module")
def dp_llm(checkpoint: tuple[Path, Any]) -> Iterator[LLM]:
    llm = LLM(
        str(checkpoint[0]),
        data_parallel_size=2,
        disable_log_stats=False,
        **{**COMMON, "skip_tokenizer_init": False},
        **CROSS_CORE,
    )
    yield llm
    llm.llm_engine.shutdown()


def _per_engine(llm: LLM, name: str) -> dict[str, int]:
    """A counter's value by engine label (summed over its other labels)."""
    totals: dict[str, int] = {}
    for metric in llm.get_metrics():
        if metric.name == f"kvserve:{name}" and isinstance(metric, Counter):
            engine = metric.labels["engine"]
            totals[engine] = totals.get(engine, 0) + metric.value
    return totals


def _greedy(max_tokens: int = MAX_TOKENS, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)


def test_two_cores_give_one_cores_tokens_and_both_serve(
    checkpoint: tuple[Path, Any], dp_llm: LLM
) -> None:
    path, reference = checkpoint
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 160) for _ in range(rng.randrange(5, 20))] for _ in range(8)]
    inputs: list[Any] = [{"prompt_token_ids": p} for p in prompts]
    dp_tokens = [
        list(o.outputs[0].token_ids) for o in dp_llm.generate(inputs, _greedy(), use_tqdm=False)
    ]
    one = LLM(str(path), **COMMON)
    try:
        one_tokens = [
            list(o.outputs[0].token_ids) for o in one.generate(inputs, _greedy(), use_tqdm=False)
        ]
    finally:
        one.llm_engine.shutdown()
    assert dp_tokens == one_tokens
    assert dp_tokens == [hf_greedy(reference, p, MAX_TOKENS) for p in prompts]
    served = _per_engine(dp_llm, "request_success")
    assert served.get("0", 0) > 0 and served.get("1", 0) > 0, served

    # n > 1: the children share the prompt's blocks, so they go to one core together.
    before = _per_engine(dp_llm, "request_success")
    (output,) = dp_llm.generate(inputs[:1], _greedy(n=3), use_tqdm=False)
    assert [list(c.token_ids) for c in output.outputs] == [dp_tokens[0]] * 3
    after = _per_engine(dp_llm, "request_success")
    grew = {e: after.get(e, 0) - before.get(e, 0) for e in after}
    assert sorted(grew.values()) == [0, 3], grew


def test_lora_and_structured_outputs_on_both_cores(
    lora_models: tuple[Path, Any, dict[str, Path]], dp_llm: LLM
) -> None:
    directory, _, adapters = lora_models
    loras = [LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(adapters.items())]
    refs = {n: merged_reference(directory, p) for n, p in adapters.items()}
    tokenizer = dp_llm.get_tokenizer()
    prompts = [tokenizer.encode(text) for text in CORPUS[:4]]
    before = _per_engine(dp_llm, "request_success")
    # Each adapter on several prompts, one request at a time: least_loaded alternates.
    for prompt in prompts:
        for lora in loras:
            (out,) = dp_llm.generate(
                [{"prompt_token_ids": prompt}], _greedy(), lora_request=lora, use_tqdm=False
            )
            expected = hf_greedy(refs[lora.lora_name], prompt, MAX_TOKENS)
            assert list(out.outputs[0].token_ids) == expected, lora.lora_name
    after = _per_engine(dp_llm, "request_success")
    assert all(after[e] - before.get(e, 0) >= 2 for e in ("0", "1")), (before, after)
    # ngram speculation ran on both cores (their own counters).
    drafted = _per_engine(dp_llm, "spec_decode_num_draft_tokens")
    assert drafted.get("0", 0) > 0 and drafted.get("1", 0) > 0, drafted

    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    params = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=spec)
    inputs: list[Any] = [{"prompt_token_ids": p} for p in prompts]
    dp_outputs = dp_llm.generate(inputs, params, use_tqdm=False)
    one = LLM(str(directory / "base"), **{**COMMON, "skip_tokenizer_init": False})
    try:
        one_outputs = one.generate(inputs, params, use_tqdm=False)
    finally:
        one.llm_engine.shutdown()
    for dp_out, one_out in zip(dp_outputs, one_outputs, strict=True):
        assert list(dp_out.outputs[0].token_ids) == list(one_out.outputs[0].token_ids)
        value = json.loads(dp_out.outputs[0].text)
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool), value


def test_aborts_reach_the_owning_core_and_no_block_leaks(dp_llm: LLM) -> None:
    engine = dp_llm.llm_engine
    client = engine.engine_core
    params = _greedy(max_tokens=64)
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7, 8, 9]}, params)
    engine.add_request("b", {"prompt_token_ids": [10, 11, 12, 13]}, params)
    assert sorted(client.balancer.owner.values()) == [0, 1]  # one on each core
    finished: dict[str, int] = {}
    aborted = False
    while engine.has_unfinished_requests():
        for output in engine.step():
            if not aborted and len(output.outputs[0].token_ids) >= 4:
                engine.abort_request("a")  # whichever request got there first: "a"'s core
                aborted = True
            if output.finished:
                finished[output.request_id] = len(output.outputs[0].token_ids)
    assert finished == {"b": 64}
    stats = client.get_stats_per_core()
    assert sorted(stats) == [0, 1]
    for core_stats in stats.values():
        assert core_stats.num_running_reqs == core_stats.num_waiting_reqs == 0
        assert core_stats.kv_cache_blocks_in_use == 0
    assert client.balancer.owner == {}


def _multi_turn(llm: LLM) -> tuple[float, list[list[int]]]:
    """Three conversations of three turns, interleaved (a turn of each in order), each
    turn's prompt the previous one + its answer + a new message. Returns the fleet's
    prefix hit rate over the workload (the cores' counters) and each conversation's
    cached tokens per turn."""
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 160) for _ in range(18)] for _ in range(3)]
    cached: list[list[int]] = [[] for _ in prompts]
    llm.reset_prefix_cache()
    queries = sum(_per_engine(llm, "prefix_cache_queries").values())
    hits = sum(_per_engine(llm, "prefix_cache_hits").values())
    for _turn in range(3):
        for conv, prompt in enumerate(prompts):
            (out,) = llm.generate([{"prompt_token_ids": prompt}], _greedy(), use_tqdm=False)
            cached[conv].append(out.num_cached_tokens or 0)
            message = [rng.randrange(3, 160) for _ in range(9)]
            prompts[conv] = [*prompt, *out.outputs[0].token_ids, *message]
    queries = sum(_per_engine(llm, "prefix_cache_queries").values()) - queries
    hits = sum(_per_engine(llm, "prefix_cache_hits").values()) - hits
    return hits / queries, cached


def test_prefix_policy_keeps_conversations_on_their_core(
    checkpoint: tuple[Path, Any], dp_llm: LLM
) -> None:
    least_loaded_rate, _ = _multi_turn(dp_llm)
    dp_llm.llm_engine.shutdown()  # one DP engine at a time: the machine is small
    prefix = LLM(
        str(checkpoint[0]),
        data_parallel_size=2,
        data_parallel_load_balance="prefix",
        disable_log_stats=False,
        **COMMON,
    )
    try:
        prefix_rate, cached = _multi_turn(prefix)
    finally:
        prefix.llm_engine.shutdown()
    # Every later turn found the whole previous turn (prompt + answer) on its core: all
    # its full blocks, the last block of the answer aside.
    first_len = 18
    for turns in cached:
        assert turns[0] == 0
        assert turns[1] >= (first_len + MAX_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert turns[2] >= (first_len + 2 * MAX_TOKENS + 9 - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert prefix_rate >= 2 * least_loaded_rate, (prefix_rate, least_loaded_rate)
