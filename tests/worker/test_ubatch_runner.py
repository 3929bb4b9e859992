"""Dual batch overlap end to end on a tiny random Llama: with --enable-dbo (thresholds so
low that every step of two or more requests is cut), TP=2 over gloo and TP=1 give
transformers' greedy tokens, which are also TP=2's without it
(tests/executor/test_multiproc_executor.py), across steps that mix prefill chunks and
decodes (a 16-token budget chunks the long prompt) and prompts that hit cached prefix
blocks; the workers did run those steps as micro-batches, every rank the same ones."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserve.entrypoints.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.executor.tiny_llama import MAX_TOKENS, hf_greedy, tiny_llama

pytestmark = pytest.mark.slow  # starts TP=2 worker processes

_rng = random.Random(0)
FIRST = [[_rng.randrange(3, 256) for _ in range(n)] for n in (6, 9, 1, 22)]
# Cached prefixes from the first round (block_size 4): 16 and 4 tokens, then new ones.
SECOND = [[*FIRST[3][:16], 7, 8, 9, 10, 11], [*FIRST[0][:4], 40, 41, 42], [99, 98, 97]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    path = Path(tmp_path_factory.mktemp("dbo_tiny_llama"))
    hf = tiny_llama()
    hf.save_pretrained(path)
    return str(path), hf


def _dbo_llm(path: str, tp: int) -> LLM:
    return LLM(
        path, skip_tokenizer_init=True, tensor_parallel_size=tp, block_size=4,
        max_num_batched_tokens=16, kv_cache_memory=4 << 20, enable_dbo=True,
        dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tp2(model: tuple[str, Any]) -> Iterator[LLM]:
    llm = _dbo_llm(model[0], 2)
    yield llm
    llm.llm_engine.shutdown()


def _ubatched_steps(llm: LLM) -> list[int]:
    executor = llm.llm_engine.engine_core.engine_core.model_executor  # type: ignore[attr-defined]
    return list(executor.collective_rpc("kvserve.benchmarks.ubatch:num_ubatched_steps"))


def _generate(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens or 0 for o in outs]


@pytest.mark.parametrize("tp", [1, 2])
def test_micro_batches_give_transformers_greedy_tokens(
    tp: int, tp2: LLM, model: tuple[str, Any]
) -> None:
    path, hf = model
    llm = tp2 if tp == 2 else _dbo_llm(path, 1)
    try:
        before = _ubatched_steps(llm)
        tokens, _ = _generate(llm, FIRST)
        assert tokens == [hf_greedy(hf, p) for p in FIRST]
        mixed = _ubatched_steps(llm)
        tokens, cached = _generate(llm, SECOND)
        assert tokens == [hf_greedy(hf, p) for p in SECOND]
        assert cached[:2] == [16, 4]  # the prefix hits
        after = _ubatched_steps(llm)
    finally:
        if llm is not tp2:
            llm.llm_engine.shutdown()
    assert len(set(after)) == 1  # every rank cut the same steps
    # Every step with two requests or more: the first round's 12 (A, B and C decode to
    # their 12th token while D's prompt is chunked in beside them; D's last 2 steps run
    # alone), the second round's 12 (its three requests finish together).
    assert (mixed[0] - before[0], after[0] - mixed[0]) == (12, 12)
