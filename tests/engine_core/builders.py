"""Builders for engine-core tests on a tiny random model: no GGUF, no download.

``tiny_llama(directory)`` saves a 2-layer random Llama with its own tokenizer;
``tiny_engine_core(directory, **engine_args)`` builds an in-process EngineCore on it.
Greedy outputs compare against the returned HF model (tests.entrypoints.
test_llm_tiny_models.hf_greedy)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvserve.args.engine_args import EngineArgs
from kvserve.engine_core.core import EngineCore
from tests.entrypoints.test_llm_tiny_models import build_model


def tiny_llama(directory: Path) -> Any:
    """Saves the tiny random Llama into ``directory``; returns the HF model."""
    return build_model("llama", directory)


def tiny_engine_core(directory: Path, **engine_args: Any) -> EngineCore:
    """An EngineCore over the checkpoint in ``directory`` with small defaults (4-token
    blocks, 16-token steps, 8 MiB of KV cache); ``engine_args`` override them."""
    args: dict[str, Any] = dict(
        block_size=4, max_num_batched_tokens=16, kv_cache_memory=8 << 20, max_model_len=256
    )
    args.update(engine_args)
    config = EngineArgs(model=str(directory), **args).create_engine_config()
    return EngineCore(config)
