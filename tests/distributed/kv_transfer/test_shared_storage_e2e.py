"""SharedStorageConnector with the real model: across processes, and with damaged files."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from kvserve.entrypoints.llm import LLM
from kvserve.kvcache.integrity import KeyedKVAuthenticator
from tests.conftest import TEST_KV_CACHE_MEMORY
from tests.distributed.kv_transfer.helpers import (
    GREEDY,
    as_json,
    core_of,
    entries,
    prompt_ids,
    run_by_hand,
    shared_storage,
)
from tests.reference import assert_no_leak, hf_reference

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def storage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shared_kv")


@pytest.fixture(scope="module")
def reader(llm_factory: Callable[..., Any], storage: Path) -> Any:
    return llm_factory(kv_transfer_config=as_json(shared_storage(storage)))


def test_second_process_loads_the_first_ones_kv(reader: Any, storage: Path) -> None:
    ids = prompt_ids(reader.get_tokenizer(), "lighthouses")
    expected = hf_reference().greedy(ids, GREEDY.max_tokens)
    config = as_json(shared_storage(storage))
    writer = LLM(
        multiprocess_mode=True, kv_cache_memory=TEST_KV_CACHE_MEMORY, kv_transfer_config=config
    )
    try:
        before = entries(storage)
        [written] = writer.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
        assert written.num_cached_tokens == 0
        assert written.outputs[0].token_ids == expected
    finally:
        writer.llm_engine.shutdown()

    # One published entry: the prompt's 3 full blocks, one safetensors file per layer.
    [entry] = entries(storage) - before
    num_layers = len(core_of(reader).kv_cache_config.kv_cache_groups[0].layer_names)
    files = sorted((storage / entry).iterdir())
    assert len(files) == num_layers
    with safe_open(str(files[0]), framework="pt") as f:
        assert f.metadata()["format"] == "kvserve-shared-storage-v1"
        assert f.get_tensor("kv").shape[:3] == (2, 3, 16)
    assert not [p for p in storage.iterdir() if p.name.startswith(".tmp")]

    # This process never saw the prompt: its 48 hit tokens are all external, and the
    # first step computes only the tail.
    scheduled, tokens, final = run_by_hand(reader, "xproc", ids)
    assert scheduled[0] == len(ids) - 48
    assert final.num_cached_tokens == 48
    assert tokens == expected
    assert_no_leak(reader)


def _damage(path: Path, how: str, marker: Path) -> None:
    if how == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif how == "delete":
        path.unlink()
    elif how == "pickle":
        # A pickle that would create `marker` if anything unpickled it.
        path.write_bytes(pickle.dumps(_Exploit(str(marker))))
    else:
        raise AssertionError(how)


class _Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("how", ["truncate", "delete", "pickle"])
def test_damaged_entry_is_recomputed(reader: Any, storage: Path, tmp_path: Path, how: str) -> None:
    ids = prompt_ids(reader.get_tokenizer(), f"damaged files ({how})")
    expected = hf_reference().greedy(ids, GREEDY.max_tokens)
    before = entries(storage)
    [first] = reader.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    [entry] = entries(storage) - before
    assert first.outputs[0].token_ids == expected

    # Damage a middle layer: the lookup still finds the entry, the load fails.
    layer_file = sorted((storage / entry).iterdir())[len(list((storage / entry).iterdir())) // 2]
    marker = tmp_path / "unpickled"
    _damage(layer_file, how, marker)
    reader.reset_prefix_cache()
    [second] = reader.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)

    assert second.outputs[0].error is None
    assert second.outputs[0].token_ids == expected
    # Every loaded block was reported bad: rolled back to token 0 and recomputed.
    assert second.num_cached_tokens == 0
    assert not marker.exists()
    assert_no_leak(reader)


@pytest.mark.parametrize("how", ["forged", "copied"])
def test_planted_layer_file_is_rejected(reader: Any, storage: Path, how: str) -> None:
    tok = reader.get_tokenizer()
    ids = prompt_ids(tok, f"planted files ({how})")
    other = [ids[1], *ids[1:]]  # as long, another first block: another entry
    expected = hf_reference().greedy(ids, GREEDY.max_tokens)
    before = entries(storage)
    reader.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    [entry] = entries(storage) - before
    victim = sorted((storage / entry).iterdir())[0]
    if how == "forged":  # right name, format and shape; bytes and MAC of a secretless peer
        with safe_open(str(victim), framework="pt") as f:
            kv, metadata = f.get_tensor("kv"), dict(f.metadata())
        metadata["mac"] = KeyedKVAuthenticator(b"an attacker's own secret").tag("x", b"", b"").hex()
        save_file({"kv": kv * 0 + 1}, str(victim), metadata)
    else:  # a valid file of another prompt's entry, copied over this one's
        before = entries(storage)
        reader.generate({"prompt_token_ids": other}, GREEDY, use_tqdm=False)
        [source] = entries(storage) - before
        victim.write_bytes((storage / source / victim.name).read_bytes())
    connector = core_of(reader).scheduler.connector
    failures = (connector.get_kv_connector_stats() or {}).get("auth_failures", {})
    reader.reset_prefix_cache()
    [second] = reader.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert second.outputs[0].token_ids == expected
    assert second.num_cached_tokens == 0  # the load failed: recomputed from token 0
    counted = connector.get_kv_connector_stats()["auth_failures"]
    assert counted["shared_storage"] == failures.get("shared_storage", 0) + 1
    assert_no_leak(reader)
