"""Greedy tokens of LLM.generate equal HF transformers' on the real model, on every path."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import pytest
import torch

from kvserve.sampling_params import SamplingParams
from tests.kernel_support import require_kernels
from tests.prompts import all_prompt_ids
from tests.reference import assert_near_greedy, assert_no_leak, hf_reference

pytestmark = pytest.mark.slow
NUM_TOKENS = 32


def greedy(max_tokens: int = NUM_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run(llm: Any, prompts: list[list[int]], **kwargs: Any) -> list[list[int]]:
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False, **kwargs
    )
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def cases(llm: Any) -> tuple[list[list[int]], list[list[int]]]:
    prompts = all_prompt_ids(llm.get_tokenizer())
    reference = hf_reference()
    return prompts, [reference.greedy(p, NUM_TOKENS) for p in prompts]


def test_longest_prompt_takes_chunks_and_split_k(cases: Any) -> None:
    """What the variants below rely on the prompt set for: its longest prompt prefills
    in several steps under a 64-token budget and the 48-token long-prefill threshold,
    and decode attention cuts its context into partitions from the first decode step."""
    from kvserve import _custom_ops as ops

    longest = max(len(p) for p in cases[0])
    assert longest > 8 * 64
    if ops.available():
        assert ops.decode_attention_partitions(longest) > 1


def test_greedy_batched_matches_hf(llm: Any, cases: Any) -> None:
    prompts, expected = cases
    assert run(llm, prompts) == expected
    assert_no_leak(llm)


def test_greedy_one_at_a_time_matches_hf(llm: Any, cases: Any) -> None:
    prompts, expected = cases
    llm.reset_prefix_cache()
    for prompt, want in zip(prompts, expected, strict=True):
        assert run(llm, [prompt]) == [want]
    assert_no_leak(llm)


@contextmanager
def token_budget(engine: Any, tokens: int) -> Iterator[None]:
    """Chunked prefill on an engine built with a larger max_num_batched_tokens: the
    scheduler reads its step budget at every step, and the runner's buffers, sized for
    the configured budget, hold any smaller step, so the steps are those of an engine
    configured with max_num_batched_tokens=tokens, without building another engine."""
    scheduler = engine.llm_engine.engine_core.engine_core.scheduler
    configured = scheduler.max_num_scheduled_tokens
    assert tokens < configured
    scheduler.max_num_scheduled_tokens = tokens
    try:
        yield
    finally:
        scheduler.max_num_scheduled_tokens = configured


# One engine for the priority policy and the long-prefill threshold (its cap on a
# prompt's chunk applies under either policy).
PRIORITY_ENGINE = {
    "scheduling_policy": "priority",
    "max_num_seqs": 3,
    "long_prefill_token_threshold": 48,
}


@pytest.mark.parametrize(
    ("engine_kwargs", "budget"),
    [
        ({}, 64),
        ({"enable_prefix_caching": False}, 64),
        ({"enable_prefix_caching": False}, None),
        (PRIORITY_ENGINE, None),
    ],
    ids=["chunked-prefill", "chunked-no-prefix-cache", "no-prefix-cache", "long-prefill-threshold"],
)
def test_scheduling_variants_match_hf(
    llm_factory: Any, cases: Any, engine_kwargs: dict, budget: int | None
) -> None:
    prompts, expected = cases
    # No kwargs: the session engine; its prefix cache holds earlier tests' prompts.
    engine = llm_factory(**engine_kwargs)
    engine.reset_prefix_cache()
    with token_budget(engine, budget) if budget else nullcontext():
        assert run(engine, prompts) == expected
        # A second pass hits the prefix cache and must not change a token (without the
        # cache it would repeat the first pass).
        if engine.llm_engine.config.cache_config.enable_prefix_caching:
            assert run(engine, prompts) == expected
    assert_no_leak(engine)


def test_priority_scheduling_matches_hf(llm_factory: Any, cases: Any) -> None:
    prompts, expected = cases
    engine = llm_factory(**PRIORITY_ENGINE)
    engine.reset_prefix_cache()
    priorities = [random.Random(7).randint(-3, 3) for _ in prompts]
    assert run(engine, prompts, priority=priorities) == expected
    assert_no_leak(engine)


def test_preemption_keeps_tokens_exact(llm_factory: Any, cases: Any) -> None:
    prompts, expected = cases
    short = [i for i, p in enumerate(prompts) if len(p) < 100]
    # 14 usable blocks of 16 tokens cannot hold all the short requests at their full length.
    engine = llm_factory(num_blocks_override=15, max_num_batched_tokens=64)
    scheduler = engine.llm_engine.engine_core.engine_core.scheduler
    before = scheduler.num_preemptions
    assert run(engine, [prompts[i] for i in short]) == [expected[i] for i in short]
    assert scheduler.num_preemptions > before
    assert_no_leak(engine)


def test_prefix_cache_hits_report_cached_tokens(llm: Any, cases: Any) -> None:
    prompts, _ = cases
    long_prompt = max(prompts, key=len)
    block = 16
    llm.reset_prefix_cache()
    first = llm.generate({"prompt_token_ids": long_prompt}, greedy(8), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0

    # Same prompt again: every full block is cached except the one holding the last token.
    again = llm.generate({"prompt_token_ids": long_prompt}, greedy(8), use_tqdm=False)[0]
    assert again.num_cached_tokens == (len(long_prompt) - 1) // block * block
    assert again.outputs[0].token_ids == first.outputs[0].token_ids

    # A different tail after a shared prefix: the shared prefix's full blocks are hits.
    shared = 330
    other = [*long_prompt[:shared], 28, 339, 1345, 30]
    out = llm.generate({"prompt_token_ids": other}, greedy(), use_tqdm=False)[0]
    assert out.num_cached_tokens == shared // block * block
    assert list(out.outputs[0].token_ids) == hf_reference().greedy(other, NUM_TOKENS)
    assert_no_leak(llm)


def test_n_samples_share_prompt_blocks(llm: Any, cases: Any) -> None:
    prompts, expected = cases
    llm.reset_prefix_cache()
    prompt = max(prompts, key=len)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    output = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert len(output.outputs) == 3
    assert [c.index for c in output.outputs] == [0, 1, 2]
    for completion in output.outputs:
        assert list(completion.token_ids) == expected[prompts.index(prompt)]
    metrics = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
    assert metrics is not None
    assert_no_leak(llm)


def test_engine_core_in_background_process_matches_hf(cases: Any) -> None:
    from kvserve.entrypoints.llm import LLM

    prompts, expected = cases
    engine = LLM(multiprocess_mode=True, kv_cache_memory=64 << 20)
    try:
        picked = [0, 3, 5, 6]
        assert run(engine, [prompts[i] for i in picked]) == [expected[i] for i in picked]
        assert not engine.llm_engine.has_unfinished_requests()
    finally:
        engine.llm_engine.shutdown()


def _model_runner(engine: Any) -> Any:
    return engine.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner


def _model(engine: Any) -> torch.nn.Module:
    return _model_runner(engine).model  # type: ignore[no-any-return]


def test_default_runs_the_gguf_blocks(llm: Any) -> None:
    """Every test above ran the default engine: for a GGUF model, the file's own blocks
    (quantization "gguf", lossless), with no float32 copy of the layers' weights."""
    from kvserve.model_executor.layers.linear import LinearBase

    require_kernels()  # without them the default falls back to float32 weights
    assert llm.llm_engine.config.model_config.quantization == "gguf"
    linears = [m for m in _model(llm).modules() if isinstance(m, LinearBase)]
    assert linears and all(m.quant_weight is not None and m.weight.numel() == 0 for m in linears)


def test_quantization_none_runs_float32_and_matches_hf(llm_factory: Any, cases: Any) -> None:
    """--quantization none dequantizes to float32 at load, as before gguf was the default;
    its plain torch fallbacks (no compiler on the machine) give the same tokens too."""
    from kvserve import _custom_ops as ops
    from kvserve.model_executor.layers.linear import LinearBase

    engine = llm_factory(quantization="none")
    linears = [m for m in _model(engine).modules() if isinstance(m, LinearBase)]
    assert linears and all(m.quant_weight is None and m.weight.numel() > 0 for m in linears)
    prompts, expected = cases
    assert run(engine, prompts) == expected
    engine.reset_prefix_cache()
    with ops.disabled():
        assert run(engine, prompts) == expected
    assert_no_leak(engine)


def test_gguf_int8_stays_near_greedy(
    llm_factory: Any, cases: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--quantization gguf_int8 rounds activations to int8. Single-stream steps always
    take the integer path; batches of 4+ rows take it with AVX-512 VNNI or AVX2 (where a
    request's tokens then do not depend on its batch) and the exact float path
    elsewhere. Decode attention's split-K cuts a request's context by its own length
    alone, so a lone long request rounds as it does in a full batch.

    Each single starts from an empty prefix cache: a prefix hit attends over the cached
    blocks through the paged kernel instead of the prompt's own keys, which differs in
    the last bits, and int8 rounding then makes that a different (still near-greedy)
    continuation, not batch variance."""
    from kvserve import _custom_ops as ops
    from kvserve.worker.thread_governor import ENV_ADAPTIVE

    require_kernels()
    monkeypatch.setenv(ENV_ADAPTIVE, "0")  # read when the engine's runner is built
    engine = llm_factory(quantization="gguf_int8")
    prompts, expected = cases
    engine.reset_prefix_cache()
    batched = run(engine, prompts)
    singles = []
    for prompt in prompts:
        engine.reset_prefix_cache()
        singles.append(run(engine, [prompt])[0])
    assert any(ops.decode_attention_partitions(len(p) + NUM_TOKENS) > 1 for p in prompts)
    if ops.packs_int8_weights():
        assert singles == batched
    else:
        assert batched == expected
    assert_near_greedy(engine, prompts, expected, singles)
    assert_no_leak(engine)


class _StepThreads:
    """Sets torch's intra-op thread count before each model step, where the runner's
    StepThreadGovernor does (its begin/end), to a seeded random choice among `counts`:
    the history of counts a governor switching under changing load can leave, made
    reproducible."""

    def __init__(self, counts: tuple[int, ...], seed: int = 0) -> None:
        self.counts = counts
        self.rng = random.Random(seed)
        self.used: list[int] = []

    def begin(self, num_tokens: int) -> None:
        threads = self.rng.choice(self.counts)
        torch.set_num_threads(threads)
        self.used.append(threads)

    def end(self) -> None:
        pass


@pytest.mark.parametrize("quantization", ["gguf", "gguf_int8"])
def test_tokens_do_not_follow_the_thread_count(
    llm: Any, llm_factory: Any, cases: Any, quantization: str
) -> None:
    """A request's tokens and their logprobs are the same bit for bit on one thread, on
    two, and with a random count at every step (as the adaptive thread governor may
    switch), in the lossless default and in gguf_int8: no kernel's arithmetic follows the
    thread count (split-K's partitions included: the longest prompt is split)."""
    from kvserve import _custom_ops as ops

    require_kernels()
    engine = llm if quantization == "gguf" else llm_factory(quantization=quantization)
    assert engine.llm_engine.config.model_config.quantization == quantization
    runner = _model_runner(engine)
    prompts = cases[0]
    assert any(ops.decode_attention_partitions(len(p) + 16) > 1 for p in prompts)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)

    def generate(steps: Any) -> list[tuple[list[int], list[float]]]:
        runner.thread_governor = steps
        engine.reset_prefix_cache()
        outputs = engine.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        done = []
        for output in outputs:
            c = output.outputs[0]
            logprobs = [step[t].logprob for t, step in zip(c.token_ids, c.logprobs, strict=True)]
            done.append((list(c.token_ids), logprobs))
        return done

    governor, threads = runner.thread_governor, torch.get_num_threads()
    try:
        one = generate(_StepThreads((1,)))
        assert generate(_StepThreads((2,))) == one
        mixed = _StepThreads((1, 2), seed=5)
        assert generate(mixed) == one
        assert set(mixed.used) == {1, 2}
    finally:
        runner.thread_governor = governor
        torch.set_num_threads(threads)
    assert_no_leak(engine)


def test_float16_kv_cache_stays_near_greedy(llm_factory: Any, cases: Any) -> None:
    """--kv-cache-dtype float16 rounds the stored keys and values once; the rest is the
    float32 model, so tokens stay HF's but at near ties."""
    engine = llm_factory(kv_cache_dtype="float16")
    runner = engine.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner
    assert {t.dtype for t in runner.kv_caches.values()} == {torch.float16}
    prompts, expected = cases
    assert_near_greedy(engine, prompts, expected, run(engine, prompts))
    assert_no_leak(engine)
