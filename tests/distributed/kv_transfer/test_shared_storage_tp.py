"""SharedStorageConnector under tensor parallelism: TP=3 on SmolLM2 (3 KV heads, one per
rank) with the mp executor. Each rank stores its own heads in its own entry; a second,
fresh set of engine processes loads every rank's part and gives transformers' greedy
tokens, and a part damaged on one rank only is recomputed on all of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from kvserve.entrypoints.llm import LLM
from tests.conftest import TEST_KV_CACHE_MEMORY
from tests.distributed.kv_transfer.helpers import GREEDY, entries, prompt_ids, shared_storage
from tests.reference import hf_reference

pytestmark = pytest.mark.slow

TP = 3


def _generate(storage: Path, prompts: list[list[int]]) -> list[Any]:
    """One engine (a fresh engine core and TP worker processes), shut down after; the
    prompts one after the other, so their entries are written in order."""
    llm = LLM(
        tensor_parallel_size=TP,
        distributed_executor_backend="mp",
        kv_cache_memory=TEST_KV_CACHE_MEMORY,
        kv_transfer_config=shared_storage(storage),
    )
    try:
        return [llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0] for p in prompts]
    finally:
        llm.llm_engine.shutdown()


def test_tp3_engines_share_per_rank_entries(llm: Any, tmp_path: Path) -> None:
    tokenizer = llm.get_tokenizer()
    prompts = [prompt_ids(tokenizer, "lighthouses"), prompt_ids(tokenizer, "glaciers")]
    expected = [hf_reference().greedy(p, GREEDY.max_tokens) for p in prompts]

    written = _generate(tmp_path, prompts)
    assert [list(o.outputs[0].token_ids) for o in written] == expected
    assert all(o.num_cached_tokens == 0 for o in written)
    # Two prompts x three ranks; each rank's layer files hold its one KV head.
    stored = sorted(entries(tmp_path))
    assert len(stored) == 2 * TP
    assert sorted(name.rsplit(".", 1)[1] for name in stored) == sorted(
        f"tp{rank}-of-{TP}" for rank in range(TP) for _ in prompts
    )
    with safe_open(str(next((tmp_path / stored[0]).iterdir())), framework="pt") as f:
        assert f.get_tensor("kv").shape[:4] == (2, 3, 16, 1)

    # Rank 2 loses a layer of the second prompt's entry: only it fails to load, and every
    # rank must recompute (the scheduler hears from one rank).
    damaged_key = _key_of_entry_missing_on_rank(tmp_path, prompts, written, rank=2)
    loaded = _generate(tmp_path, prompts)
    assert [list(o.outputs[0].token_ids) for o in loaded] == expected
    assert loaded[0].num_cached_tokens == 48  # three full blocks from every rank's entry
    assert loaded[1].num_cached_tokens == 0, damaged_key  # rolled back and recomputed


def _key_of_entry_missing_on_rank(
    root: Path, prompts: list[list[int]], outputs: list[Any], rank: int
) -> str:
    """Deletes one layer file of the second prompt's entry on ``rank`` (the one written
    last); returns its key."""
    entries_by_time = sorted(
        (p for p in root.iterdir() if p.name.endswith(f".tp{rank}-of-{TP}")),
        key=lambda p: p.stat().st_mtime_ns,
    )
    assert len(entries_by_time) == len(prompts) == len(outputs)
    victim = entries_by_time[-1]
    layer_files = sorted(victim.iterdir())
    layer_files[len(layer_files) // 2].unlink()
    return victim.name.rsplit(".", 1)[0]
