"""Executor: how the engine core reaches its workers, whatever process they live in."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Literal, overload

from kvserve.config import EngineConfig
from kvserve.protocol.kv_cache_interface import KVCacheConfig, KVCacheSpec
from kvserve.protocol.runner_output import ModelRunnerOutput
from kvserve.protocol.scheduler_output import GrammarOutput, SchedulerOutput


class ExecutorFailedError(RuntimeError):
    """A worker is gone (its process died, its actor failed): the executor cannot run
    another step, and the engine must fail at once instead of retrying the step."""


class Executor(ABC):
    """Fans every call out to all workers with ``collective_rpc``; the driver worker's
    (rank 0) answer is the one the engine uses."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._init_executor()

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        backend = config.parallel_config.distributed_executor_backend
        if backend == "uni":
            from kvserve.executor.uniproc_executor import UniProcExecutor

            return UniProcExecutor
        if backend == "mp":
            from kvserve.executor.multiproc_executor import MultiprocExecutor

            return MultiprocExecutor
        if backend == "ray":
            from kvserve.executor.ray_executor import RayDistributedExecutor

            return RayDistributedExecutor
        raise ValueError(f"unknown distributed_executor_backend {backend!r}")

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers, set up their devices and load the model."""

    @abstractmethod
    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Call ``method`` on every worker and return the results in rank order.

        ``method``: a worker method's name, or a function taking the worker as its
        first argument (across processes: an importable one, or its ``module:function``
        path). ``unique_reply_rank``: only that rank's result is returned (still a
        one-element list). ``non_block``: a Future of that list instead. ``timeout``
        (seconds): TimeoutError when the workers have not answered by then."""

    def failure_fd(self) -> int | None:
        """A file descriptor that becomes readable when a worker is lost, for an event
        loop to wait on beside its sockets (None: workers live in this process)."""
        return None

    def check_failed(self) -> None:
        """Raises ExecutorFailedError once a worker is lost (never, in-process)."""
        return None

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.collective_rpc("initialize_from_config", args=(kv_cache_config,))

    def get_kv_cache_specs(self) -> list[dict[str, KVCacheSpec]]:
        return self.collective_rpc("get_kv_cache_spec")

    def determine_available_memory(self) -> list[int]:
        """Each worker's KV cache bytes (profiled on CUDA under gpu_memory_utilization)."""
        return [int(n) for n in self.collective_rpc("determine_available_memory")]

    @property
    def max_concurrent_batches(self) -> int:
        """Micro-batches the engine core may keep in flight (its batch queue): one
        here; the number of pipeline stages where workers run in their own processes."""
        return 1

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> Future[Any] | None:
        """The forward on every rank. ``non_block``: a Future that fails if it did
        (sample_tokens' Future fails too, so the batch queue need only wait on that)."""
        self.collective_rpc("execute_model", args=(scheduler_output,))
        return _done(None) if non_block else None

    @overload
    def sample_tokens(
        self, grammar_output: GrammarOutput | None = None, non_block: Literal[False] = False
    ) -> ModelRunnerOutput: ...
    @overload
    def sample_tokens(
        self, grammar_output: GrammarOutput | None, non_block: Literal[True]
    ) -> Future[ModelRunnerOutput]: ...
    def sample_tokens(
        self, grammar_output: GrammarOutput | None = None, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """The sampled tokens of the step execute_model ran (``non_block``: a Future)."""
        output = self.collective_rpc("sample_tokens", args=(grammar_output,))[0]
        assert isinstance(output, ModelRunnerOutput)
        return _done(output) if non_block else output

    def check_health(self) -> None:
        self.collective_rpc("check_health")

    def shutdown(self) -> None:
        self.collective_rpc("shutdown")


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future
