from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from kvserve.executor import Executor, UniProcExecutor
from kvserve.protocol.kv_cache_interface import build_kv_cache_config
from kvserve.protocol.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from kvserve.sampling_params import SamplingParams
from kvserve.worker.worker import Worker


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    path = tmp_path_factory.mktemp("tiny_llama_exec")
    torch.manual_seed(0)
    hf_config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=128,
        max_position_embeddings=64,
        initializer_range=0.1,
    )
    LlamaForCausalLM(hf_config).save_pretrained(path)
    return EngineConfig(
        ModelConfig(model=str(path)),
        CacheConfig(block_size=4, num_blocks_override=16),
        SchedulerConfig(),
        device_config=DeviceConfig("cpu"),
    )


def test_get_class_by_backend(config: EngineConfig) -> None:
    from kvserve.executor.multiproc_executor import MultiprocExecutor

    assert Executor.get_class(config) is UniProcExecutor

    def with_backend(backend: str, tp: int = 1) -> EngineConfig:
        return EngineConfig(
            config.model_config,
            config.cache_config,
            config.scheduler_config,
            ParallelConfig(tensor_parallel_size=tp, distributed_executor_backend=backend),  # type: ignore[arg-type]
        )

    from kvserve.executor.ray_executor import RayDistributedExecutor

    assert Executor.get_class(with_backend("mp")) is MultiprocExecutor
    assert Executor.get_class(with_backend("ray")) is RayDistributedExecutor
    # More than one rank defaults to processes; 'uni' cannot hold them.
    assert ParallelConfig(tensor_parallel_size=2).distributed_executor_backend == "mp"
    with pytest.raises(ValueError, match="'uni' runs one worker"):
        with_backend("uni", tp=2)


def test_uniproc_executor_runs_a_step(config: EngineConfig) -> None:
    executor = UniProcExecutor(config)
    try:
        specs = executor.get_kv_cache_specs()
        # No gpu_memory_utilization profile off CUDA: the configured size.
        assert executor.determine_available_memory() == [config.cache_config.kv_cache_memory]
        assert len(specs) == 1 and len(specs[0]) == 2
        executor.initialize_from_config(build_kv_cache_config(specs[0], 0, num_blocks_override=16))
        executor.check_health()
        ranks = executor.collective_rpc(lambda worker, k: (worker.rank, k), kwargs={"k": 3})
        assert ranks == [(0, 3)]

        prompt = [5, 6, 7, 8, 9]
        new = NewRequestData("r", prompt, SamplingParams(temperature=0.0), ([1, 2],), 0)
        executor.execute_model(SchedulerOutput([new], CachedRequestData(), {"r": 5}, 5))
        out = executor.sample_tokens()
        assert out.req_ids == ["r"] and len(out.sampled_token_ids[0]) == 1
        # The in-process worker's state is visible through a callable RPC.
        state = executor.collective_rpc(lambda w: w.model_runner.requests["r"].output_token_ids)
        assert state == [out.sampled_token_ids[0]]
    finally:
        executor.shutdown()


def test_worker_requires_init_device(config: EngineConfig) -> None:
    worker = Worker(config)
    with pytest.raises(RuntimeError, match="init_device"):
        worker.load_model()


def test_async_worker_thread_owns_the_intra_op_threads(config: EngineConfig) -> None:
    # The model's OpenMP team is the worker thread's alone: a parallel op on the engine
    # core's thread would start a second team, and libgomp then throttles every barrier
    # (executor/uniproc_executor.py). The caller gets its count back at shutdown.
    threads = torch.get_num_threads()
    async_config = EngineConfig(
        config.model_config,
        config.cache_config,
        SchedulerConfig(async_scheduling=True),
        device_config=DeviceConfig("cpu"),
    )
    executor = UniProcExecutor(async_config)
    try:
        assert executor.max_concurrent_batches == 2
        assert torch.get_num_threads() == 1
        assert executor.collective_rpc(lambda worker: torch.get_num_threads()) == [threads]
    finally:
        executor.shutdown()
    assert torch.get_num_threads() == threads


def test_inline_call_futures_carry_the_result_or_the_error(config: EngineConfig) -> None:
    """Synchronous steps hand out futures born done; a call's error is the future's."""
    executor = UniProcExecutor(config)
    try:
        specs = executor.get_kv_cache_specs()
        executor.initialize_from_config(build_kv_cache_config(specs[0], 0, num_blocks_override=16))
        failed = executor.sample_tokens(None, non_block=True)  # no execute_model before it
        assert failed.done() and not failed.running() and not failed.cancelled()
        assert isinstance(failed.exception(), RuntimeError)
        with pytest.raises(RuntimeError, match="without a preceding execute_model"):
            failed.result()
        new = NewRequestData("r", [5, 6, 7], SamplingParams(temperature=0.0), ([1],), 0)
        started = executor.execute_model(
            SchedulerOutput([new], CachedRequestData(), {"r": 3}, 3), non_block=True
        )
        assert started is not None and started.done() and started.exception() is None
        sampled = executor.sample_tokens(None, non_block=True)
        seen: list[object] = []
        sampled.add_done_callback(seen.append)
        assert seen == [sampled] and sampled.result().req_ids == ["r"]
    finally:
        executor.shutdown()
