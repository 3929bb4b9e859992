"""Worker: owns one device and the ModelRunner on it."""

from __future__ import annotations

import gc
import os
from typing import Any

import torch

from kvserve.attention.backends.registry import set_attention_backend
from kvserve.config import EngineConfig
from kvserve.distributed.parallel_state import (
    destroy_distributed_environment,
    init_worker_distributed_environment,
)
from kvserve.model_executor.layers.fused_moe import FusedMoE
from kvserve.model_executor.models.registry import ModelRegistry
from kvserve.protocol.kv_cache_interface import KVCacheConfig, KVCacheSpec
from kvserve.protocol.runner_output import ModelRunnerOutput
from kvserve.protocol.scheduler_output import GrammarOutput, SchedulerOutput
from kvserve.sample.logits_processor.loader import load_logits_processors
from kvserve.utils.census import per_request_objects
from kvserve.worker.gpu_memory_profiler import GPUMemoryProfiler
from kvserve.worker.model_runner import ModelRunner
from kvserve.worker.worker_base import WorkerBase


class Worker(WorkerBase):
    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        local_rank: int = 0,
        distributed_init_method: str | None = None,
    ) -> None:
        super().__init__(config, rank, local_rank, distributed_init_method)
        # Unseeded sampling draws from the global generator: seed it for reproducible runs.
        torch.manual_seed(config.model_config.seed)
        self.device: torch.device | None = None
        self._model_runner: ModelRunner | None = None
        # Steps this rank joined with no requests of its own (expert parallelism).
        self.num_dummy_batches = 0
        # CUDA with gpu_memory_utilization: sizes the KV cache from a memory profile.
        self.memory_profiler: GPUMemoryProfiler | None = None

    @property
    def model_runner(self) -> ModelRunner:
        if self._model_runner is None:
            raise RuntimeError("init_device() must run first")
        return self._model_runner

    def init_device(self) -> None:
        device_type = self.config.device_config.device
        if device_type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("device 'cuda' was requested but CUDA is not available")
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
            torch.cuda.manual_seed_all(self.config.model_config.seed)
            utilization = self.config.cache_config.gpu_memory_utilization
            if utilization is not None:
                self.memory_profiler = GPUMemoryProfiler(utilization, self.device)
        else:
            self.device = torch.device(device_type)
        if self.config.parallel_config.distributed_world_size > 1:
            init_worker_distributed_environment(
                self.config.parallel_config, self.rank, self.distributed_init_method, self.device
            )
        # The layers built by load_model pick their backend from the registry.
        set_attention_backend(self.config.device_config.attention_backend)
        self._model_runner = ModelRunner(self.config, self.device)

    def load_model(self) -> None:
        # Models registered out of tree in the front end; this may be a fresh process.
        for arch, target in self.config.model_config.model_registrations:
            ModelRegistry.register_model(arch, target)
        self.model_runner.load_model()

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return self.model_runner.get_kv_cache_spec()

    def determine_available_memory(self) -> int:
        """The KV cache's bytes on this worker: what gpu_memory_utilization's share of
        the device leaves after a memory profile (CUDA), else kv_cache_memory."""
        if self.memory_profiler is None:
            return self.config.cache_config.kv_cache_memory
        return self.memory_profiler.kv_cache_budget(self.model_runner.model, self.config)

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.model_runner.initialize_kv_cache(kv_cache_config)
        if self.memory_profiler is not None:
            self.memory_profiler.report_capture(self.model_runner.cuda_graphs.pool_bytes)
        custom = self.config.model_config.logits_processors
        if custom:
            # The runner's batch is built with the built-in processors; the user's join it
            # here, before it holds a request.
            batch = self.model_runner.input_batch
            assert batch is not None
            batch.sampling_batch.add_logits_processors(load_logits_processors(custom))

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self.model_runner.execute_model(scheduler_output)

    @torch.inference_mode()
    def execute_dummy_batch(self) -> None:
        """Joins every MoE layer's collectives with no tokens: the step of a core without
        requests while another core steps (expert parallelism, engine_core/dp_wave.py)."""
        for layer in self._moe_layers():
            layer.dummy_forward()
        self.num_dummy_batches += 1

    def _moe_layers(self) -> list[FusedMoE]:
        model = self.model_runner.model
        return [m for m in model.modules() if isinstance(m, FusedMoE)]

    def expert_placement(self) -> dict[str, int]:
        """Which experts this rank holds, and how many expert weights it loaded."""
        layers = self._moe_layers()
        if not layers:
            return {"moe_layers": 0, "dummy_batches": self.num_dummy_batches}
        placement = layers[0].placement
        return {
            "moe_layers": len(layers),
            "ep_rank": placement.ep_rank,
            "ep_size": placement.ep_size,
            "first_local_expert": placement.first_local_expert,
            "num_local_experts": placement.num_local_experts,
            "expert_params": sum(m.w13_weight.numel() + m.w2_weight.numel() for m in layers),
            "dummy_batches": self.num_dummy_batches,
        }

    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        return self.model_runner.sample_tokens(grammar_output)

    def get_kv_connector_handshake_metadata(self) -> dict[str, str] | None:
        return self.model_runner.kv_connector_runner.get_handshake_metadata()

    def request_census(self) -> dict[str, Any]:
        """This worker's per-request census, with its process id: a worker in the engine
        core's process shares that process's object counts."""
        census = self._model_runner.request_census() if self._model_runner else {}
        return {"pid": os.getpid(), "owners": census, "objects": per_request_objects()}

    def sleep(self, level: int = 1) -> int:
        """vLLM's sleep mode: frees the KV cache (and the weights, level 2); the bytes freed."""
        return self.model_runner.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Gives back what sleep freed: every tag, or those of ("weights", "kv_cache")."""
        self.model_runner.sleep_mode.wake_up(tags)

    def check_health(self) -> None:
        if self._model_runner is None or self._model_runner.model is None:
            raise RuntimeError(f"worker {self.rank} has no model loaded")

    def shutdown(self) -> None:
        if self._model_runner is not None:
            self._model_runner.shutdown()
        self._model_runner = None
        if self.config.parallel_config.distributed_world_size > 1:
            destroy_distributed_environment()
        gc.collect()
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()
