"""A user connector (kv_connector_module_path) loading asynchronously, inside a MultiConnector
with a SharedStorageConnector, on the real model; load failures under both policies."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.kv_transfer.connectors_for_tests import AsyncLoadingConnector
from tests.distributed.kv_transfer.helpers import (
    GREEDY,
    as_json,
    async_loading,
    core_of,
    drain,
    entries,
    multi,
    prompt_ids,
    shared_storage,
    with_params,
)
from tests.reference import assert_no_leak, hf_reference

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: tmp_path_factory.mktemp(name) for name in ("a", "b", "fail_a", "fail_b")}


@pytest.fixture(scope="module")
def llm(llm_factory: Callable[..., Any], dirs: dict[str, Path]) -> Any:
    config = multi(async_loading(dirs["a"]), shared_storage(dirs["b"]))
    return llm_factory(kv_transfer_config=as_json(config))


@pytest.fixture(scope="module")
def failing_llm(llm_factory: Callable[..., Any], dirs: dict[str, Path]) -> Any:
    config = multi(
        async_loading(dirs["fail_a"]),
        shared_storage(dirs["fail_b"]),
        kv_load_failure_policy="fail",
    )
    return llm_factory(kv_transfer_config=as_json(config))


def _serve_and_forget(llm: Any, ids: list[int], dirs: list[Path]) -> list[str]:
    """Serves ids once (every child saves it), then drops the local prefix cache so the
    next request can only hit external KV. Returns the new entry of each dir."""
    before = [entries(d) for d in dirs]
    [out] = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == hf_reference().greedy(ids, GREEDY.max_tokens)
    new = [entries(d) - b for d, b in zip(dirs, before, strict=True)]
    assert all(len(n) == 1 for n in new), new  # all children save
    assert llm.reset_prefix_cache()
    return [n.pop() for n in new]


def test_async_load_waits_for_remote_kvs_and_matches(llm: Any, dirs: dict[str, Path]) -> None:
    ids = prompt_ids(llm.get_tokenizer(), "async loads")
    _serve_and_forget(llm, ids, [dirs["a"], dirs["b"]])
    AsyncLoadingConnector.observed_statuses.clear()
    [out] = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    # The first child has the KV: it loads it on a thread while the request waits.
    assert "WAITING_FOR_REMOTE_KVS" in AsyncLoadingConnector.observed_statuses[out.request_id]
    assert out.num_cached_tokens == 48
    assert out.outputs[0].token_ids == hf_reference().greedy(ids, GREEDY.max_tokens)
    assert_no_leak(llm)


def test_second_child_loads_when_the_first_has_nothing(llm: Any, dirs: dict[str, Path]) -> None:
    ids = prompt_ids(llm.get_tokenizer(), "fallback stores")
    entry_a, _ = _serve_and_forget(llm, ids, [dirs["a"], dirs["b"]])
    shutil.rmtree(dirs["a"] / entry_a)
    AsyncLoadingConnector.observed_statuses.clear()
    [out] = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    # SharedStorageConnector loaded it synchronously: the request never waited.
    assert out.request_id not in AsyncLoadingConnector.observed_statuses
    assert out.num_cached_tokens == 48
    assert out.outputs[0].token_ids == hf_reference().greedy(ids, GREEDY.max_tokens)
    assert_no_leak(llm)


def test_reported_bad_block_is_recomputed(llm: Any, dirs: dict[str, Path]) -> None:
    ids = prompt_ids(llm.get_tokenizer(), "bad blocks")
    _serve_and_forget(llm, ids, [dirs["a"], dirs["b"]])
    # Block 1 of 3 is overwritten with noise and reported: blocks 0 stays, the rest reruns.
    [out] = llm.generate(
        {"prompt_token_ids": ids}, with_params({"fail_block_index": 1}), use_tqdm=False
    )
    assert out.outputs[0].error is None
    assert out.num_cached_tokens == 16
    assert out.outputs[0].token_ids == hf_reference().greedy(ids, GREEDY.max_tokens)
    assert_no_leak(llm)


def test_delayed_free_holds_blocks_until_sent(llm: Any) -> None:
    ids = prompt_ids(llm.get_tokenizer(), "slow sends")
    [out] = llm.generate(
        {"prompt_token_ids": ids}, with_params({"delay_free": True}), use_tqdm=False
    )
    engine_id = core_of(llm).config.kv_transfer_config.engine_id
    assert out.kv_transfer_params == {"sent_by": engine_id}
    scheduler = core_of(llm).scheduler
    pool = scheduler.kv_cache_manager.block_pool
    # Finished, but its 4 blocks stay with the connector until it reports them sent.
    assert out.request_id in scheduler.kv_transfer.delayed_free
    assert pool.get_num_free_blocks() == core_of(llm).kv_cache_config.num_blocks - 1 - 4
    drain(llm)
    assert not scheduler.kv_transfer.delayed_free
    assert_no_leak(llm)


def test_fail_policy_ends_sync_and_async_loads_with_an_error(
    failing_llm: Any, dirs: dict[str, Path]
) -> None:
    llm = failing_llm
    tokenizer = llm.get_tokenizer()
    # Async (first child): a reported bad block fails the request once its load is done.
    async_ids = prompt_ids(tokenizer, "failing async loads")
    _serve_and_forget(llm, async_ids, [dirs["fail_a"], dirs["fail_b"]])
    [out] = llm.generate(
        {"prompt_token_ids": async_ids}, with_params({"fail_block_index": 0}), use_tqdm=False
    )
    assert out.outputs[0].finish_reason == "error"
    assert "kv_load_failure_policy is 'fail'" in (out.error or "")
    assert out.outputs[0].token_ids == []
    assert_no_leak(llm)

    # Sync (second child): its file is damaged after the lookup found the entry.
    sync_ids = prompt_ids(tokenizer, "failing sync loads")
    entry_a, entry_b = _serve_and_forget(llm, sync_ids, [dirs["fail_a"], dirs["fail_b"]])
    shutil.rmtree(dirs["fail_a"] / entry_a)
    for layer_file in sorted((dirs["fail_b"] / entry_b).iterdir())[:1]:
        layer_file.write_bytes(b"not a safetensors file")
    [out] = llm.generate({"prompt_token_ids": sync_ids}, GREEDY, use_tqdm=False)
    assert out.outputs[0].finish_reason == "error"
    assert "failed to load external KV" in (out.error or "")
    assert_no_leak(llm)

    # The engine keeps serving: a prompt it has no external KV for runs normally.
    fresh = prompt_ids(tokenizer, "life after failures")
    [out] = llm.generate({"prompt_token_ids": fresh}, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == hf_reference().greedy(fresh, GREEDY.max_tokens)
    assert_no_leak(llm)
