"""The Scheduler with a real scheduler-side connector, driven by hand-made runner outputs."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from kvserve.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
)
from kvserve.core.kv_cache_utils import get_request_block_hasher
from kvserve.core.request import Request, RequestStatus
from kvserve.core.sched.scheduler import Scheduler
from kvserve.distributed.kv_transfer.kv_connector.connectors.shared_storage import (
    SharedStorageConnectorMetadata,
    prefix_keys,
)
from kvserve.protocol.engine_core import EngineCoreOutputs, FinishReason
from kvserve.protocol.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from kvserve.protocol.kv_connector_output import KVConnectorOutput
from kvserve.protocol.runner_output import ModelRunnerOutput
from kvserve.protocol.scheduler_output import SchedulerOutput
from kvserve.sampling_params import SamplingParams
from tests.distributed.kv_transfer.helpers import async_loading, shared_storage

BS = 4
NUM_BLOCKS = 32
PROMPT = list(range(100, 110))  # 2 full blocks stored externally + 2 tail tokens
TOKEN = 7


@pytest.fixture(scope="module")
def model_config() -> ModelConfig:
    return ModelConfig(max_model_len=256)


def make_scheduler(model_config: ModelConfig, transfer: dict[str, Any]) -> Scheduler:
    mc = copy.copy(model_config)
    config = EngineConfig(
        mc,
        CacheConfig(block_size=BS),
        SchedulerConfig(max_model_len=256),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(**transfer),
    )
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8)
    kv_config = KVCacheConfig(NUM_BLOCKS, [KVCacheGroupSpec(["layers.0.attn"], spec)])
    return Scheduler.from_config(config, kv_config)


def publish_prompt(scheduler: Scheduler, root: Path) -> None:
    """Makes the store hold PROMPT's 2 full blocks (the scheduler side only looks)."""
    connector: Any = scheduler.connector
    *_, key = prefix_keys(PROMPT[: 2 * BS], BS, connector._request_salt(None))
    (root / key).mkdir()


def add_request(scheduler: Scheduler, **params: Any) -> Request:
    request = Request(
        "r",
        list(PROMPT),
        SamplingParams(max_tokens=2, ignore_eos=True),
        eos_token_id=None,
        block_hasher=get_request_block_hasher(BS, 0),
        kv_transfer_params=params or None,
    )
    scheduler.add_request(request)
    return request


def step(scheduler: Scheduler, **kv_output: Any) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    """One step; ``kv_output`` is what the worker-side connector reports (KVConnectorOutput)."""
    out = scheduler.schedule()
    req_ids = list(out.num_scheduled_tokens)
    sampled = [
        [TOKEN]
        if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens
        else []
        for r in req_ids
    ]
    runner_output = ModelRunnerOutput(
        req_ids,
        {r: i for i, r in enumerate(req_ids)},
        sampled,
        kv_connector_output=KVConnectorOutput(**kv_output),
    )
    outputs = scheduler.update_from_output(out, runner_output)
    scheduler.check_integrity()
    return out, outputs


def assert_all_free(scheduler: Scheduler) -> None:
    scheduler.check_integrity()
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 1


def test_external_hit_then_bad_block_recomputes_from_it(
    model_config: ModelConfig, tmp_path: Path
) -> None:
    scheduler = make_scheduler(model_config, shared_storage(tmp_path))
    publish_prompt(scheduler, tmp_path)
    request = add_request(scheduler)
    out = scheduler.schedule()
    # 8 external tokens count as computed: only the 2-token tail runs.
    assert out.num_scheduled_tokens == {"r": 2}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8
    assert request.num_external_computed_tokens == 8 and request.num_cached_tokens == 8
    meta = out.kv_connector_metadata
    assert isinstance(meta, SharedStorageConnectorMetadata)
    [load] = meta.loads
    blocks = scheduler.kv_cache_manager.get_block_ids("r")[0]
    assert (load.start_block, load.end_block, load.block_ids) == (0, 2, [blocks[:2]])

    # The worker reports the second loaded block unreadable: this step's token is void.
    runner_output = ModelRunnerOutput(
        ["r"],
        {"r": 0},
        [[TOKEN]],
        kv_connector_output=KVConnectorOutput(invalid_block_ids={blocks[1]}),
    )
    outputs = scheduler.update_from_output(out, runner_output)
    assert outputs.outputs == []
    assert request.num_computed_tokens == BS and request.num_output_tokens == 0
    # Blocks holding unverified external KV never became prefix-cache entries.
    assert (
        scheduler.kv_cache_manager.block_pool.get_cached_block(request.block_hashes[1], [0]) is None
    )

    out, outputs = step(scheduler)
    assert out.num_scheduled_tokens == {"r": len(PROMPT) - BS}  # recompute from block 1
    assert out.scheduled_cached_reqs.num_output_tokens == [0]
    assert [o.new_token_ids for o in outputs.outputs] == [[TOKEN]]
    assert request.num_cached_tokens == BS
    while scheduler.has_requests():
        step(scheduler)
    assert_all_free(scheduler)


def test_fail_policy_finishes_with_an_error_and_frees(
    model_config: ModelConfig, tmp_path: Path
) -> None:
    scheduler = make_scheduler(
        model_config, shared_storage(tmp_path, kv_load_failure_policy="fail")
    )
    publish_prompt(scheduler, tmp_path)
    request = add_request(scheduler)
    out = scheduler.schedule()
    blocks = scheduler.kv_cache_manager.get_block_ids("r")[0]
    runner_output = ModelRunnerOutput(
        ["r"],
        {"r": 0},
        [[TOKEN]],
        kv_connector_output=KVConnectorOutput(invalid_block_ids={blocks[0]}),
    )
    [output] = scheduler.update_from_output(out, runner_output).outputs
    assert output.finish_reason == FinishReason.ERROR and output.new_token_ids == []
    assert output.error is not None and "kv_load_failure_policy is 'fail'" in output.error
    assert request.status == RequestStatus.FINISHED_ERROR
    assert not scheduler.running and not scheduler.requests
    assert scheduler.table.finished_req_ids == {"r"}  # the workers drop it next step
    assert_all_free(scheduler)


def test_async_load_parks_until_finished_recving(model_config: ModelConfig, tmp_path: Path) -> None:
    scheduler = make_scheduler(model_config, async_loading(tmp_path))
    publish_prompt(scheduler, tmp_path)
    request = add_request(scheduler)
    out, outputs = step(scheduler)
    # Blocks are allocated for the load, but nothing is computed while it runs.
    assert out.num_scheduled_tokens == {} and not outputs.outputs
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(out.kv_connector_metadata.loads) == 1
    assert scheduler.has_requests()
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {}  # still loading

    # The load ends with its second block unreadable: keep block 0, compute the rest.
    blocks = scheduler.kv_cache_manager.get_block_ids("r")[0]
    out, _ = step(scheduler, finished_recving={"r"}, invalid_block_ids={blocks[1]})
    assert request.status == RequestStatus.WAITING and request.num_computed_tokens == BS
    out, outputs = step(scheduler)
    # Not looked up (nor parked) again although the store still has 8 tokens.
    assert out.num_scheduled_tokens == {"r": len(PROMPT) - BS}
    assert out.scheduled_new_reqs[0].num_computed_tokens == BS
    assert out.scheduled_new_reqs[0].block_ids[0][:2] == blocks  # kept its blocks
    assert [o.new_token_ids for o in outputs.outputs] == [[TOKEN]]
    while scheduler.has_requests():
        step(scheduler)
    assert_all_free(scheduler)


def test_async_delayed_free_waits_for_finished_sending(
    model_config: ModelConfig, tmp_path: Path
) -> None:
    scheduler = make_scheduler(model_config, async_loading(tmp_path))
    add_request(scheduler, delay_free=True)
    final = None
    while final is None:
        _, outputs = step(scheduler)
        final = next((o for o in outputs.outputs if o.finished), None)
    assert final.kv_transfer_params is not None and "sent_by" in final.kv_transfer_params
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() < NUM_BLOCKS - 1  # held for the send
    assert scheduler.has_requests()  # the engine keeps stepping to poll the send
    out, _ = step(scheduler)
    assert out.kv_connector_metadata.sends == ["r"]
    step(scheduler, finished_sending={"r"})
    assert not scheduler.has_requests()
    assert_all_free(scheduler)
