"""LLM.collective_rpc: a Worker method by name, or a callable run with the worker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve.entrypoints.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.entrypoints.test_llm_tiny_models import build_model


def embedding_rows(worker: Any, token_ids: list[int]) -> torch.Tensor:
    """Runs in the worker: the rows of the loaded model's input embedding."""
    embed = worker.model_runner.model.model.embed_tokens
    return embed.forward(torch.tensor(token_ids, device=worker.device)).cpu()


def test_collective_rpc_reaches_the_worker(tmp_path: Path) -> None:
    reference = build_model("llama", tmp_path)
    llm = LLM(str(tmp_path), kv_cache_memory=8 << 20)
    try:
        assert llm.collective_rpc("check_health") == [None]
        [rows] = llm.collective_rpc(embedding_rows, args=([1, 5, 7],))
        expected = reference.get_input_embeddings()(torch.tensor([1, 5, 7]))
        torch.testing.assert_close(rows, expected)
        [rank] = llm.collective_rpc(
            lambda worker, offset: worker.rank + offset, kwargs={"offset": 3}
        )
        assert rank == 3
        with pytest.raises(AttributeError):
            llm.collective_rpc("no_such_method")
        # The engine serves on after the calls.
        out = llm.generate("the quick", SamplingParams(max_tokens=2), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        llm.llm_engine.shutdown()


def test_collective_rpc_needs_the_in_process_core(tmp_path: Path) -> None:
    build_model("llama", tmp_path)
    llm = LLM(str(tmp_path), kv_cache_memory=8 << 20, multiprocess_mode=True)
    try:
        with pytest.raises(ValueError, match="multiprocess_mode=False"):
            llm.collective_rpc("check_health")
    finally:
        llm.llm_engine.shutdown()
