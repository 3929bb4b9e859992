"""Expert parallelism across data-parallel cores: ``LLM(..., data_parallel_size=2,
enable_expert_parallel=True)`` on a tiny random Mixtral (token ids, no tokenizer).

Each core holds half the experts (from the workers' own parameter counts), attention
runs on each core's own requests, and tokens are dispatched to every expert's rank and
combined back: greedy tokens identical to HF transformers and to one core without
expert parallelism. A batch of one request leaves a core with nothing to do; it joins
the other's steps with dummy ones (counted by its worker) and nothing hangs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserve.config import ParallelConfig
from kvserve.engine.exceptions import EngineDeadError
from kvserve.entrypoints.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.family_models import build_family_model, hf_greedy

MAX_TOKENS = 6
COMMON: dict[str, Any] = dict(skip_tokenizer_init=True, block_size=4, kv_cache_memory=8 << 20)
PROMPTS = [[5, 9, 23, 40, 7], [3, 3, 50, 61, 2, 17, 88], [100, 12], [44, 45, 46, 47, 48, 49]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("mixtral_ep")
    return path, build_family_model("mixtral", path)


@pytest.fixture(scope="module")
def ep_llm(checkpoint: tuple[Path, Any]) -> Iterator[LLM]:
    llm = LLM(str(checkpoint[0]), data_parallel_size=2, enable_expert_parallel=True, **COMMON)
    yield llm
    llm.llm_engine.shutdown()


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _placements(llm: LLM) -> list[dict[str, int]]:
    """Every worker's expert placement, by data-parallel rank (one worker per core)."""
    per_core = llm.llm_engine.engine_core.call_utility("collective_rpc", "expert_placement")
    return [workers[0] for workers in per_core]


def test_tokens_match_hf_and_one_core_without_expert_parallel(
    checkpoint: tuple[Path, Any], ep_llm: LLM
) -> None:
    path, hf = checkpoint
    expected = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    assert _generate(ep_llm, PROMPTS) == expected
    one = LLM(str(path), **COMMON)
    try:
        assert _generate(one, PROMPTS) == expected
    finally:
        one.llm_engine.shutdown()


def test_each_rank_holds_only_its_experts(checkpoint: tuple[Path, Any], ep_llm: LLM) -> None:
    hf = checkpoint[1]
    experts_total = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
    placements = _placements(ep_llm)
    assert [p["ep_rank"] for p in placements] == [0, 1]
    assert all(p["ep_size"] == 2 and p["num_local_experts"] == 4 for p in placements)
    assert [p["first_local_expert"] for p in placements] == [0, 4]
    assert [p["expert_params"] for p in placements] == [experts_total // 2] * 2


def test_one_request_leaves_a_core_idle_without_hanging(
    checkpoint: tuple[Path, Any], ep_llm: LLM
) -> None:
    before = [p["dummy_batches"] for p in _placements(ep_llm)]
    prompt = PROMPTS[1]
    assert _generate(ep_llm, [prompt]) == [hf_greedy(checkpoint[1], prompt, MAX_TOKENS)]
    after = [p["dummy_batches"] for p in _placements(ep_llm)]
    # The idle core joined every step of the busy one: at least its prefill + decodes.
    assert max(a - b for a, b in zip(after, before, strict=True)) >= MAX_TOKENS


def test_expert_parallel_refuses_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        ParallelConfig(pipeline_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="data_parallel_tolerate_failure"):
        ParallelConfig(
            data_parallel_size=2, data_parallel_tolerate_failure=True, enable_expert_parallel=True
        )


def test_a_dead_core_stops_its_peer_and_the_engine(ep_llm: LLM) -> None:
    """Last in the module (it ends the shared engine): the surviving core, idle in the
    wave's agreement, leaves instead of waiting on its dead peer, and the engine reports
    the death instead of hanging."""
    cores = ep_llm.llm_engine.engine_core.cores  # type: ignore[attr-defined]
    cores[0].proc.kill()
    cores[1].proc.join(timeout=30)
    assert not cores[1].proc.is_alive()
    with pytest.raises(EngineDeadError):
        _generate(ep_llm, PROMPTS[:1])
