"""KV connectors on a hybrid model: Gemma 3 270M's sliding-window and global groups saved
by one engine process and loaded by another, through SharedStorage and the tiered cache
(disk tier), with tokens identical to HF transformers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvserve.entrypoints.llm import LLM
from kvserve.protocol.kv_cache_interface import KVCacheConfig
from tests.distributed.kv_transfer.helpers import as_json, shared_storage
from tests.gemma3_fixtures import GEMMA3, GEMMA3_KV_CACHE_MEMORY, Gemma3HFReference
from tests.reference import assert_no_leak

pytestmark = pytest.mark.slow
MAX_TOKENS = 8


def ask(llm: Any, ids: list[int]) -> tuple[list[int], int]:
    from kvserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    return list(out.outputs[0].token_ids), out.num_cached_tokens or 0


def write_in_another_process(config: str, ids: list[int]) -> list[int]:
    """A writer engine whose core runs in its own process: computes, saves, shuts down."""
    writer = LLM(
        model=GEMMA3,
        multiprocess_mode=True,
        kv_cache_memory=GEMMA3_KV_CACHE_MEMORY,
        kv_transfer_config=config,
    )
    try:
        tokens, cached = ask(writer, ids)
        assert cached == 0
        return tokens
    finally:
        writer.llm_engine.shutdown()


@pytest.fixture(scope="module")
def document(gemma3_prompts: list[list[int]]) -> list[int]:
    """~1,200 tokens: the window layers must load more than their 512-token window."""
    return next(p for p in gemma3_prompts if 1000 < len(p) < 1500)


def test_shared_storage_across_processes(
    gemma3_llm_factory: Callable[..., Any],
    gemma3_hf: Gemma3HFReference,
    document: list[int],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    config = as_json(shared_storage(tmp_path_factory.mktemp("gemma_shared_kv")))
    expected = gemma3_hf.greedy(document, MAX_TOKENS)
    assert write_in_another_process(config, document) == expected
    reader = gemma3_llm_factory(kv_transfer_config=config)
    core = reader.llm_engine.engine_core.engine_core
    kv_config: KVCacheConfig = core.kv_cache_config
    assert len(kv_config.kv_cache_groups) == 6
    block_size = kv_config.block_size
    tokens, cached = ask(reader, document)
    assert cached == (len(document) - 1) // block_size * block_size
    assert tokens == expected
    assert_no_leak(reader)


def test_tiered_cache_across_processes(
    gemma3_llm_factory: Callable[..., Any],
    gemma3_hf: Gemma3HFReference,
    document: list[int],
    tmp_path: Path,
) -> None:
    extra = {"local_disk": str(tmp_path / "disk"), "local_cpu": False}
    config = json.dumps(
        {"kv_connector": "TieredCacheConnector", "kv_connector_extra_config": extra}
    )
    expected = gemma3_hf.greedy(document, MAX_TOKENS)
    assert write_in_another_process(config, document) == expected
    reader = gemma3_llm_factory(kv_transfer_config=config)
    tokens, cached = ask(reader, document)
    assert cached == len(document) // 256 * 256  # the disk tier's whole chunks
    assert tokens == expected
    assert_no_leak(reader)


def test_layouts_a_connector_cannot_serve_are_refused() -> None:
    from kvserve.distributed.kv_transfer.kv_connector.utils import check_connector_layout
    from kvserve.protocol.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    heads = {"block_size": 16, "num_kv_heads": 1, "head_size": 8}
    full = KVCacheGroupSpec(["a"], FullAttentionSpec(**heads))
    window = KVCacheGroupSpec(["b"], SlidingWindowSpec(sliding_window=128, **heads))
    chunked = KVCacheGroupSpec(["c"], ChunkedLocalAttentionSpec(attention_chunk_size=64, **heads))
    assert check_connector_layout(KVCacheConfig(8, [full, window]), "X", 0) == [128]
    with pytest.raises(ValueError, match=r"X cannot serve .*sliding_window_128"):
        check_connector_layout(KVCacheConfig(8, [full, window]), "X", 256)
    with pytest.raises(ValueError, match="chunked_local_attention"):
        check_connector_layout(KVCacheConfig(8, [full, chunked]), "X", 0)
