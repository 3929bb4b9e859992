"""Greedy steps served by the LM head's greedy screen (greedy_head.py, greedy_screen.py),
forced on with KVSERVE_GREEDY_SCREEN=1 whatever the CPU (by default it is on where the
integer GEMV is the cheaper, AVX2 without AVX-512): SmolLM2's greedy tokens equal HF
transformers' alone, batched, after chunked prefill and on a prefix hit, beside requests
that need the logits (logprobs, penalties, a grammar), under n-gram speculation with
asynchronous scheduling; and the screen did serve the steps it can."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from kvserve import _custom_ops as ops
from kvserve.model_executor.layers.greedy_screen import ENV_GREEDY_SCREEN
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from kvserve.worker.greedy_head import NoGreedyHead, ScreenedGreedyHead
from tests.conftest import TEST_KV_CACHE_MEMORY
from tests.kernel_support import require_kernels
from tests.reference import assert_no_leak, hf_reference

require_kernels()

MAX_TOKENS = 24
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Photosynthesis is the process by which green plants",
    "The three primary colors are",
    "Once upon a time, in a small village by the sea,",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


def _runner(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner


class _Served:
    """Counts the steps whose tokens the screen gave (the runner's greedy head wrapped)."""

    def __init__(self, llm: Any) -> None:
        self.head = _runner(llm).greedy_head
        assert isinstance(self.head, ScreenedGreedyHead)
        self.steps = 0
        tokens = self.head.tokens

        def counted(*args: Any) -> Any:
            out = tokens(*args)
            self.steps += out is not None
            return out

        self.head.tokens = counted  # type: ignore[method-assign,assignment]

    def take(self) -> int:
        steps, self.steps = self.steps, 0
        return steps


def _screened_llm(**kwargs: Any) -> Any:
    from kvserve.entrypoints.llm import LLM

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV_GREEDY_SCREEN, "1")
        return LLM(kv_cache_memory=TEST_KV_CACHE_MEMORY, **kwargs)


@pytest.fixture(scope="module")
def screened() -> Iterator[tuple[Any, _Served]]:
    """64-token prefill chunks, prefix caching on (the defaults)."""
    llm = _screened_llm(max_num_batched_tokens=64)
    yield llm, _Served(llm)
    llm.llm_engine.shutdown()


def _ids(llm: Any, texts: list[str]) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    return [list(tokenizer.encode(t)) for t in texts]


def _generate(llm: Any, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_default_is_on_where_the_integer_gemv_is_cheaper(llm: Any) -> None:
    head = _runner(llm).greedy_head
    want = ScreenedGreedyHead if ops.integer_gemv_is_cheaper() else NoGreedyHead
    assert type(head) is want


def test_single_streams_and_small_batches_match_hf(screened: tuple[Any, _Served]) -> None:
    llm, served = screened
    prompts = _ids(llm, PROMPTS)
    expected = [hf_reference().greedy(p, MAX_TOKENS) for p in prompts]
    for prompt, want in zip(prompts[:2], expected, strict=False):
        assert _generate(llm, [prompt], GREEDY) == [want]
    # Every token, the first too (the prompt's last position alone reaches the head).
    assert served.take() == 2 * MAX_TOKENS
    assert _generate(llm, prompts[:3], GREEDY) == expected[:3]
    assert served.take() >= MAX_TOKENS - 1
    # Five rows: more than the integer GEMV takes without its interleaved copy.
    assert _generate(llm, prompts, GREEDY) == expected
    assert served.take() == 0
    assert_no_leak(llm)


def test_chunked_prefill_and_prefix_hit_match_hf(screened: tuple[Any, _Served]) -> None:
    llm, served = screened
    text = " ".join(f"Step {i}: add {i * 7 % 13} grams of flour and stir." for i in range(30))
    (prompt,) = _ids(llm, [text + " The total is"])
    assert len(prompt) > 4 * 64
    want = hf_reference().greedy(prompt, MAX_TOKENS)
    assert _generate(llm, [prompt], GREEDY) == [want]
    assert _generate(llm, [prompt], GREEDY) == [want]  # its blocks come from the cache now
    assert served.take() == 2 * MAX_TOKENS
    assert_no_leak(llm)


def test_requests_that_need_logits_take_them(screened: tuple[Any, _Served]) -> None:
    llm, served = screened
    prompts = _ids(llm, PROMPTS[:3])
    want = hf_reference().greedy(prompts[0], MAX_TOKENS)
    logprobs = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    penalised = SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.3)
    choice = SamplingParams(
        temperature=0.0,
        max_tokens=8,
        structured_outputs=StructuredOutputsParams(choice=["Paris", "London"]),
    )
    for other in (logprobs, penalised, choice):
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts[:2]], [GREEDY, other], use_tqdm=False
        )
        assert list(outputs[0].outputs[0].token_ids) == want
        if other is logprobs:
            assert outputs[1].outputs[0].logprobs is not None
            assert list(outputs[1].outputs[0].token_ids) == hf_reference().greedy(
                prompts[1], MAX_TOKENS
            )
        if other is choice:
            assert outputs[1].outputs[0].text in ("Paris", "London")
    # Only the greedy request's steps after the other one finished were screened: none
    # beside the logprobs request, at least 16 each beside the 8-token ones.
    assert 2 * (MAX_TOKENS - 8) <= served.take() < 2 * MAX_TOKENS
    assert_no_leak(llm)


def test_ngram_speculation_with_async_scheduling_matches_hf() -> None:
    llm = _screened_llm(speculative_config=json.dumps(NGRAM), async_scheduling=True)
    try:
        served = _Served(llm)
        text = "one two three four five one two three four five one two three"
        prompts = _ids(llm, [text, PROMPTS[1]])
        expected = [hf_reference().greedy(p, MAX_TOKENS) for p in prompts]
        for prompt, want in zip(prompts, expected, strict=True):
            assert _generate(llm, [prompt], GREEDY) == [want]
        # Steps with drafts verify them on the logits; the rest are screened.
        assert 0 < served.take() < 2 * MAX_TOKENS
        assert_no_leak(llm)
    finally:
        llm.llm_engine.shutdown()
