"""SharedStorageConnector's two sides on small tensors: keys, atomic saves, loads, faults."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import pytest
import torch

from kvserve.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
)
from kvserve.core.request import Request
from kvserve.distributed.kv_transfer import KVConnectorRole
from kvserve.distributed.kv_transfer.kv_connector.connectors.shared_storage import (
    SharedStorageConnector,
    SharedStorageConnectorMetadata,
    prefix_keys,
)
from kvserve.forward_context import set_forward_context
from kvserve.protocol.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from kvserve.sampling_params import SamplingParams
from tests.distributed.kv_transfer.helpers import entries, shared_storage

BS = 4
LAYERS = ("layers.0.attn", "layers.1.attn")
PROMPT = list(range(100, 110))  # 2 full blocks and a tail of 2


@pytest.fixture(scope="module")
def model_config() -> ModelConfig:
    return ModelConfig(max_model_len=256)


class Blocks:
    def __init__(self, *ids: int) -> None:
        self.ids = list(ids)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


def make(model_config: ModelConfig, root: Path, role: KVConnectorRole) -> SharedStorageConnector:
    config = EngineConfig(
        model_config,
        CacheConfig(block_size=BS),
        SchedulerConfig(max_model_len=256),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(**shared_storage(root)),
    )
    return SharedStorageConnector(config, role)


def caches(seed: int | None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed or 0)
    shape = (2, 8, BS, 2, 4)
    return {
        name: torch.randn(shape, generator=gen) if seed is not None else torch.zeros(shape)
        for name in LAYERS
    }


def request(req_id: str = "r") -> Request:
    return Request(req_id, list(PROMPT), SamplingParams(max_tokens=4), eos_token_id=None)


def plan_save(model_config: ModelConfig, root: Path) -> SharedStorageConnectorMetadata:
    """The scheduler side's plan to save PROMPT, computed in one step in blocks 3, 5, 6."""
    scheduler = make(model_config, root, KVConnectorRole.SCHEDULER)
    req = request()
    scheduler.update_state_after_alloc(req, Blocks(3, 5, 6), 0)
    output = SchedulerOutput(
        [NewRequestData("r", list(PROMPT), req.sampling_params, ([3, 5, 6],), 0)],
        CachedRequestData(),
        {"r": len(PROMPT)},
        len(PROMPT),
    )
    meta = scheduler.build_connector_meta(output)
    assert isinstance(meta, SharedStorageConnectorMetadata)
    [spec] = meta.saves
    assert spec.block_ids == [[3, 5]]  # the prompt's full blocks only (one group)
    return meta


def run_save(
    model_config: ModelConfig,
    root: Path,
    kv: dict[str, torch.Tensor],
    meta: SharedStorageConnectorMetadata,
) -> None:
    worker = make(model_config, root, KVConnectorRole.WORKER)
    worker.register_kv_caches(kv)
    worker.bind_connector_metadata(meta)
    before = entries(root)
    for name in LAYERS:
        worker.save_kv_layer(name, kv[name], None)
    assert entries(root) == before  # nothing is visible before the entry is complete
    worker.wait_for_save()
    worker.clear_connector_metadata()


def save(model_config: ModelConfig, root: Path, kv: dict[str, torch.Tensor]) -> None:
    run_save(model_config, root, kv, plan_save(model_config, root))


def load(
    model_config: ModelConfig, root: Path, num_computed: int, block_ids: list[int]
) -> tuple[dict[str, torch.Tensor], set[int], int | None]:
    """Looks PROMPT up with num_computed local tokens and loads into zeroed caches."""
    scheduler = make(model_config, root, KVConnectorRole.SCHEDULER)
    req = request()
    num_external, load_async = scheduler.get_num_new_matched_tokens(req, num_computed)
    assert not load_async
    kv = caches(None)
    if num_external:
        scheduler.update_state_after_alloc(req, Blocks(*block_ids), num_external)
    worker = make(model_config, root, KVConnectorRole.WORKER)
    worker.register_kv_caches(kv)
    worker.bind_connector_metadata(scheduler.build_connector_meta(SchedulerOutput.empty()))
    with set_forward_context(None, kv_connector=worker) as ctx:
        worker.start_load_kv(ctx)
        for name in LAYERS:
            worker.wait_for_layer_load(name)
    return kv, worker.get_block_ids_with_load_errors(), num_external


def test_prefix_keys_are_chained_and_deterministic() -> None:
    keys = list(prefix_keys(list(range(12)), 4, "salt"))
    assert len(keys) == 3
    assert list(prefix_keys(list(range(8)), 4, "salt")) == keys[:2]
    expected = hashlib.sha256(b"salt" + struct.pack("<4q", 0, 1, 2, 3)).hexdigest()
    assert keys[0] == expected
    assert list(prefix_keys(list(range(12)), 4, "other")) != keys


def test_saved_prompt_loads_into_other_blocks(model_config: ModelConfig, tmp_path: Path) -> None:
    kv = caches(seed=1)
    save(model_config, tmp_path, kv)
    [entry] = entries(tmp_path)
    assert sorted(p.name for p in (tmp_path / entry).iterdir()) == [
        f"{name}.safetensors" for name in LAYERS
    ]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]

    loaded, errors, num_external = load(model_config, tmp_path, 0, [6, 2, 7])
    assert num_external == 8 and not errors
    for name in LAYERS:
        assert torch.equal(loaded[name][:, [6, 2]], kv[name][:, [3, 5]])

    # With the first block a local hit, only the second one is external.
    loaded, errors, num_external = load(model_config, tmp_path, 4, [1, 4, 7])
    assert num_external == 4 and not errors
    for name in LAYERS:
        assert torch.equal(loaded[name][:, 4], kv[name][:, 5])
        assert not loaded[name][:, 1].any()


@pytest.mark.parametrize("fault", ["missing", "garbage", "wrong_shape"])
def test_unreadable_layer_is_a_load_error(
    model_config: ModelConfig, tmp_path: Path, fault: str
) -> None:
    save(model_config, tmp_path, caches(seed=2))
    [entry] = entries(tmp_path)
    path = tmp_path / entry / f"{LAYERS[1]}.safetensors"
    if fault == "missing":
        path.unlink()
    elif fault == "garbage":
        path.write_bytes(b"\x00" * 64)
    else:
        from safetensors.torch import save_file

        metadata = {"format": "kvserve-shared-storage-v1"}
        save_file({"kv": torch.zeros(2, 2, BS, 3, 4)}, str(path), metadata)
    _, errors, num_external = load(model_config, tmp_path, 0, [6, 2, 7])
    assert num_external == 8
    assert errors == {6, 2}


def test_concurrent_writers_publish_one_entry(model_config: ModelConfig, tmp_path: Path) -> None:
    # Two engines plan the same save before either publishes; the second rename loses.
    plans = [plan_save(model_config, tmp_path), plan_save(model_config, tmp_path)]
    run_save(model_config, tmp_path, caches(seed=3), plans[0])
    first = {p.name: p.read_bytes() for p in next(tmp_path.iterdir()).iterdir()}
    run_save(model_config, tmp_path, caches(seed=4), plans[1])
    [entry] = entries(tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert {p.name: p.read_bytes() for p in (tmp_path / entry).iterdir()} == first


def test_consumer_does_not_save_and_producer_does_not_load(
    model_config: ModelConfig, tmp_path: Path
) -> None:
    save(model_config, tmp_path, caches(seed=5))
    config = EngineConfig(
        model_config,
        CacheConfig(block_size=BS),
        SchedulerConfig(max_model_len=256),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(**shared_storage(tmp_path, kv_role="kv_producer")),
    )
    producer = SharedStorageConnector(config, KVConnectorRole.SCHEDULER)
    assert producer.get_num_new_matched_tokens(request(), 0) == (0, False)
