"""How the engine runs: KV cache, scheduler budgets, parallel layout and device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvserve.config.model import KV_CACHE_DTYPES, QUANTIZED_KV_CACHE_DTYPES, GiB


@dataclass
class CacheConfig:
    block_size: int = 16
    # Bytes for the paged KV cache of all layers together.
    kv_cache_memory: int = 1 * GiB
    enable_prefix_caching: bool = True
    # Seed of the block hash, so every process and machine agrees on block keys.
    prefix_caching_hash_seed: int = 0
    num_blocks_override: int | None = None
    # CUDA only (vLLM's meaning): the share of the device's total memory this instance may
    # use; the worker profiles the weights, activations and CUDA graphs and kv_cache_memory
    # is replaced by what they leave (worker/gpu_memory_profiler.py). None: kv_cache_memory.
    gpu_memory_utilization: float | None = None
    # Element type of the paged KV cache (vLLM's --kv-cache-dtype). "auto" is the model's
    # dtype; float16 / bfloat16 halve the cache's bytes (decode attention at long contexts
    # is bound by reading them) at the cost of rounding the stored keys and values.
    cache_dtype: str = "auto"
    # StreamingLLM (0 = off): full-attention layers keep the first attention_sinks tokens
    # and a window of max_model_len - attention_sinks recent ones, so a sequence may grow
    # past max_model_len, up to sink_max_seq_len (default 8x max_model_len).
    attention_sinks: int = 0
    sink_max_seq_len: int | None = None

    def __post_init__(self) -> None:
        if self.attention_sinks < 0:
            raise ValueError(f"attention_sinks must be >= 0, got {self.attention_sinks}")
        if self.sink_max_seq_len is not None and not self.attention_sinks:
            raise ValueError("sink_max_seq_len needs attention_sinks > 0")
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.cache_dtype!r}"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive bytes, got {self.kv_cache_memory}")
        utilization = self.gpu_memory_utilization
        if utilization is not None and (isinstance(utilization, bool) or not 0 < utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
        if self.num_blocks_override is not None and self.num_blocks_override < 2:
            raise ValueError(
                f"num_blocks_override must be at least 2, got {self.num_blocks_override}"
            )

    def kv_dtype(self, model_dtype: str) -> str:
        """The cache's element type by name ("auto": the model's; the fp8 names: int8)."""
        if self.cache_dtype in QUANTIZED_KV_CACHE_DTYPES:
            return "int8"
        return model_dtype if self.cache_dtype == "auto" else self.cache_dtype


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    # A prefill longer than this is chunked even when the budget could take it (0 = off).
    long_prefill_token_threshold: int = 0
    policy: Literal["fcfs", "priority"] = "fcfs"
    # vLLM's async scheduling: the next step is scheduled (its requests' sampled tokens
    # still placeholders) while the current one's forward runs on the worker's thread
    # (core/sched/in_flight.py). EngineConfig turns it off where it is not supported.
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool, got {self.async_scheduling!r}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")

    def verify_against_model_len(self) -> None:
        """Called once max_model_len is known from the model."""
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_model_len ({self.max_model_len}) when chunked prefill is disabled"
            )


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: Literal["uni", "mp", "ray"] | None = None
    # Pipeline parallelism: keep up to pipeline_parallel_size micro-batches in flight so
    # the stages overlap (the engine core's batch queue); False runs one step at a time.
    batch_queue: bool = True
    # Data parallelism: this many engine cores, each with its own scheduler, KV cache and
    # tensor/pipeline workers, behind one front end (engine/dp_client.py). The rank is
    # the core's own index, set in each core's copy of the config.
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # How the front end picks a core for a new request: "least_loaded" (vLLM's internal
    # balancing: the fewest waiting, then running requests) or "prefix" (the core that
    # holds the longest cached prefix of the prompt, unless it is overloaded).
    data_parallel_load_balance: Literal["least_loaded", "prefix"] = "least_loaded"
    # A dead core fails only its own requests (503) while the others keep serving;
    # without it, one dead core takes the whole engine down.
    data_parallel_tolerate_failure: bool = False
    # Expert parallelism (MoE models): the experts are sharded across the
    # data_parallel_size x tensor_parallel_size ranks instead of split on their
    # intermediate dim; with data_parallel_size > 1 the workers of every core join one
    # torch.distributed world and the cores step in lockstep (engine_core/dp_wave.py).
    enable_expert_parallel: bool = False
    # Where the cores run (vLLM's names): "mp", processes this front end spawns for its
    # data_parallel_size_local ranks (the others come from --headless nodes); "ray", one
    # Ray actor per rank, placed across the cluster's nodes (engine/dp_ray.py).
    data_parallel_backend: Literal["mp", "ray"] = "mp"
    # Ranks run on this node: [data_parallel_start_rank, + data_parallel_size_local).
    # None: all of them (mp), or none here (ray: every rank is an actor).
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    # The front end's address and handshake port, where the cores it did not spawn
    # connect (None: 127.0.0.1, or this node's address in the Ray cluster); cores that
    # share experts meet at the same address.
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int = 29550
    # With expert parallelism across cores: their workers' torch.distributed world on
    # data_parallel_master_port, the cores' own step-agreement group on the next port;
    # unset, the front end picks free ports before it starts the cores.
    data_parallel_master_port: int | None = None
    data_parallel_wave_port: int | None = None
    # External load balancing (vLLM's --data-parallel-rank): this front end runs only
    # the core of data_parallel_rank; one server per rank, balanced by the caller.
    data_parallel_external_lb: bool = False
    # Dual batch overlap (vLLM's DBO, worker/ubatch_runner.py): a step big enough is cut
    # into two micro-batches whose forwards take turns at each tensor-parallel all-reduce,
    # one's communication overlapping the other's compute. A decode-only step is cut from
    # dbo_decode_token_threshold tokens, a step with a prefill from the other threshold.
    enable_dbo: bool = False
    dbo_decode_token_threshold: int = 32
    dbo_prefill_token_threshold: int = 512

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be >= 1")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank must be in [0, {self.data_parallel_size}), "
                f"got {self.data_parallel_rank}"
            )
        if self.data_parallel_load_balance not in ("least_loaded", "prefix"):
            raise ValueError(
                "data_parallel_load_balance must be 'least_loaded' or 'prefix', "
                f"got {self.data_parallel_load_balance!r}"
            )
        self._check_data_parallel_layout()
        if not isinstance(self.batch_queue, bool):
            raise ValueError(f"batch_queue must be a bool, got {self.batch_queue!r}")
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if self.world_size == 1 else "mp"
        if self.world_size > 1 and self.distributed_executor_backend == "uni":
            raise ValueError(
                f"distributed_executor_backend='uni' runs one worker, but tensor_parallel_size"
                f" x pipeline_parallel_size = {self.world_size}: use 'mp'"
            )

        if self.enable_expert_parallel:
            self._check_expert_parallel()
        if self.enable_dbo:
            self._check_dbo()

    def _check_dbo(self) -> None:
        for name in ("dbo_decode_token_threshold", "dbo_prefill_token_threshold"):
            if getattr(self, name) < 2:
                raise ValueError(
                    f"{name} must be >= 2 (two micro-batches), got {getattr(self, name)}"
                )
        if self.pipeline_parallel_size > 1:
            raise ValueError("enable_dbo does not run with pipeline_parallel_size > 1")
        if self.expert_parallel_across_dp:
            # Each core would cut its own steps, so the cores' collectives would not pair up.
            raise ValueError(
                "enable_dbo does not run with enable_expert_parallel across data_parallel_size > 1"
            )

    def _check_expert_parallel(self) -> None:
        if self.pipeline_parallel_size > 1:
            raise ValueError(
                "enable_expert_parallel does not run with pipeline_parallel_size > 1 "
                f"(got {self.pipeline_parallel_size})"
            )
        if self.data_parallel_size > 1 and self.data_parallel_tolerate_failure:
            raise ValueError(
                "data_parallel_tolerate_failure cannot be used with enable_expert_parallel: "
                "every core takes part in every MoE layer, so no core can go on without another"
            )

    def _check_data_parallel_layout(self) -> None:
        size = self.data_parallel_size
        if self.data_parallel_backend not in ("mp", "ray"):
            raise ValueError(
                f"data_parallel_backend must be 'mp' or 'ray', got {self.data_parallel_backend!r}"
            )
        local = self.data_parallel_size_local
        if local is not None and not 0 <= local <= size:
            raise ValueError(
                f"data_parallel_size_local must be in [0, data_parallel_size={size}], got {local}"
            )
        if not 0 <= self.data_parallel_start_rank < size:
            raise ValueError(
                f"data_parallel_start_rank must be in [0, {size}), "
                f"got {self.data_parallel_start_rank}"
            )
        if local is not None and self.data_parallel_start_rank + local > size:
            raise ValueError(
                f"data_parallel_start_rank + data_parallel_size_local = "
                f"{self.data_parallel_start_rank + local} exceeds data_parallel_size={size}"
            )
        if self.data_parallel_external_lb and (
            self.data_parallel_backend != "mp" or local not in (None, 1)
        ):
            raise ValueError(
                "data_parallel_rank (external load balancing) runs one local mp core: "
                "leave data_parallel_backend and data_parallel_size_local unset"
            )
        if self.data_parallel_backend == "ray" and local:
            raise ValueError("data_parallel_size_local: with the ray backend Ray places every rank")
        if not 0 <= self.data_parallel_rpc_port < 65536:
            raise ValueError(
                f"data_parallel_rpc_port must be a TCP port, got {self.data_parallel_rpc_port}"
            )

    @property
    def front_end_balances(self) -> bool:
        """Several cores behind this front end (DPClient), not one rank's core alone."""
        return self.data_parallel_size > 1 and not self.data_parallel_external_lb

    @property
    def local_data_parallel_ranks(self) -> range:
        """The ranks this node's front end (or headless launcher) spawns."""
        if self.data_parallel_backend == "ray":
            return range(0)
        local = self.data_parallel_size_local
        if local is None:
            local = self.data_parallel_size - self.data_parallel_start_rank
        return range(self.data_parallel_start_rank, self.data_parallel_start_rank + local)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def expert_parallel_across_dp(self) -> bool:
        """Whether the cores' workers share one torch.distributed world (and the cores
        step together): expert parallelism with several data-parallel cores."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    @property
    def distributed_world_size(self) -> int:
        """The ranks of the torch.distributed world a worker joins (1: none)."""
        if self.expert_parallel_across_dp:
            return self.world_size * self.data_parallel_size
        return self.world_size


def _cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch (seconds) where the installed
    build has no GPU backend: the front end builds this config before it spawns the
    engine core, and must not pay for torch there."""
    import importlib.util
    import re
    import sys

    spec = importlib.util.find_spec("torch") if "torch" not in sys.modules else None
    if spec is not None and spec.submodule_search_locations:
        try:
            with open(f"{spec.submodule_search_locations[0]}/version.py", encoding="utf-8") as f:
                version = f.read()
        except OSError:
            version = ""
        # A CPU-only build writes `cuda: Optional[str] = None` and the same for hip.
        gpu_free = r"^{}\s*(:[^=]*)?=\s*None\s*$"
        if all(re.search(gpu_free.format(key), version, re.M) for key in ("cuda", "hip")):
            return False
    import torch

    return torch.cuda.is_available()


# --attention-backend's names (vLLM's); None chooses by device (attention/backends/registry).
ATTENTION_BACKENDS = ("CPU_ATTN", "TRITON", "FLASH_ATTN", "FLASHINFER")


@dataclass
class DeviceConfig:
    device: str = "auto"
    # Forces the attention backend in the workers; FLASH_ATTN / FLASHINFER give way to
    # TRITON (logged) where their wheel or CUDA is missing.
    attention_backend: str | None = None

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if _cuda_available() else "cpu"
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {self.device!r}")
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )


# Frozen (hence hashable): an engine's event stream is fixed once it starts.
