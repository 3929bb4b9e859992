"""CUDA graphs on a GPU: decode steps replayed from the captured graphs give the eager
engine's greedy tokens (float32, the default model), padded batches sample only their
own rows, and steps with prefills run eagerly. Skipped, naming why, without CUDA."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (CUDA graph capture and replay)", allow_module_level=True)

from kvserve.entrypoints.llm import LLM
from kvserve.sampling_params import SamplingParams
from kvserve.worker.cuda_graph_runner import CUDAGraphRunner

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time"]
ENGINE = {"device": "cuda", "dtype": "float32", "max_model_len": 512, "max_num_seqs": 8,
          "kv_cache_memory": "256M"}  # fmt: skip


def _runner(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner


@pytest.fixture(scope="module")
def eager_tokens() -> list[list[int]]:
    llm = LLM(**ENGINE, enforce_eager=True)
    try:
        assert not isinstance(_runner(llm).cuda_graphs, CUDAGraphRunner)
        return _greedy(llm, PROMPTS)
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def graphs() -> Iterator[LLM]:
    llm = LLM(**ENGINE)
    yield llm
    llm.llm_engine.shutdown()


def _greedy(llm: LLM, prompts: list[str], n: int = 24) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_graphs_are_captured_for_vllms_sizes(graphs: LLM) -> None:
    runner = _runner(graphs).cuda_graphs
    assert isinstance(runner, CUDAGraphRunner)
    assert runner.captured_sizes == (1, 2, 4, 8)


def test_replayed_decodes_give_the_eager_tokens(graphs: LLM, eager_tokens: list[list[int]]) -> None:
    """Three requests decode as a padded batch of 4; one alone as a batch of 1."""
    assert _greedy(graphs, PROMPTS) == eager_tokens
    assert _greedy(graphs, PROMPTS[:1]) == eager_tokens[:1]


def test_padding_rows_leak_no_kv_blocks(graphs: LLM) -> None:
    core = graphs.llm_engine.engine_core.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    _greedy(graphs, PROMPTS)
    assert pool.get_num_free_blocks() == free_before


def test_batches_past_the_largest_graph_run_eagerly(
    graphs: LLM, eager_tokens: list[list[int]]
) -> None:
    """Nine requests (max_num_seqs=8 caps a step at 8 decodes) and a prefill arriving
    mid-decode: steps the graphs do not cover still give the same tokens."""
    prompts = PROMPTS * 3
    assert _greedy(graphs, prompts) == eager_tokens * 3
