"""Engine configuration: flat dataclasses, each validated in __post_init__."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from kvserve.transformers_utils.arch_config import ArchConfig, load_arch_config
from kvserve.transformers_utils.model_resolver import ResolvedModel, resolve_model

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
GiB = 1 << 30


@dataclass
class ModelConfig:
    model: str | None = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "float32"
    max_model_len: int | None = None
    seed: int = 0
    served_model_name: str | None = None
    resolved: ResolvedModel = field(init=False)
    arch: ArchConfig = field(init=False)
    tokenizer_resolved: ResolvedModel = field(init=False)

    def __post_init__(self) -> None:
        self.resolved = resolve_model(self.model)
        # A separate tokenizer source (a GGUF or HF directory); the model's own by default.
        self.tokenizer_resolved = resolve_model(self.tokenizer) if self.tokenizer else self.resolved
        self.arch = load_arch_config(self.resolved)
        if self.dtype not in ("float32", "auto"):
            raise ValueError(f"dtype must be 'float32' (or 'auto'), got {self.dtype!r}")
        self.dtype = "float32"
        limit = self.arch.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = limit
        elif not 0 < self.max_model_len <= limit:
            raise ValueError(
                f"max_model_len must be in [1, {limit}] (the model's max_position_embeddings), "
                f"got {self.max_model_len}"
            )
        if self.served_model_name is None:
            self.served_model_name = self.resolved.name

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size


@dataclass
class CacheConfig:
    block_size: int = 16
    # Bytes for the paged KV cache of all layers together.
    kv_cache_memory: int = 1 * GiB
    enable_prefix_caching: bool = True
    # Seed of the block hash, so every process and machine agrees on block keys.
    prefix_caching_hash_seed: int = 0
    num_blocks_override: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive bytes, got {self.kv_cache_memory}")
        if self.num_blocks_override is not None and self.num_blocks_override < 2:
            raise ValueError(
                f"num_blocks_override must be at least 2, got {self.num_blocks_override}"
            )


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    # A prefill longer than this is chunked even when the budget could take it (0 = off).
    long_prefill_token_threshold: int = 0
    policy: Literal["fcfs", "priority"] = "fcfs"

    def __post_init__(self) -> None:
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

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be >= 1")
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if self.world_size == 1 else "mp"
        if self.world_size > 1:
            raise ValueError("tensor/pipeline parallelism is not supported yet (size must be 1)")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class DeviceConfig:
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.device == "auto":
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {self.device!r}")


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    kv_transfer_config: Any = None

    def __post_init__(self) -> None:
        assert self.model_config.max_model_len is not None
        self.scheduler_config.max_model_len = self.model_config.max_model_len
        self.scheduler_config.verify_against_model_len()
