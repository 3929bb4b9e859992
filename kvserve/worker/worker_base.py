"""The interface every worker (one per device) offers to an executor."""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvserve.config import EngineConfig
from kvserve.protocol.kv_cache_interface import KVCacheConfig, KVCacheSpec
from kvserve.protocol.runner_output import ModelRunnerOutput
from kvserve.protocol.scheduler_output import GrammarOutput, SchedulerOutput


class WorkerBase(ABC):
    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        local_rank: int = 0,
        distributed_init_method: str | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.distributed_init_method = distributed_init_method

    @abstractmethod
    def init_device(self) -> None:
        """Pick and set up this worker's device (and process group, when distributed)."""

    @abstractmethod
    def load_model(self) -> None: ...

    @abstractmethod
    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]: ...

    @abstractmethod
    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate the KV cache the engine sized for all workers."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Run the forward pass of one step; sample_tokens() finishes it."""

    @abstractmethod
    def sample_tokens(
        self, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput | None: ...

    @abstractmethod
    def check_health(self) -> None:
        """Raise if the worker cannot serve."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release what the worker holds (device memory, process groups)."""
