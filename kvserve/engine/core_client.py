"""How the front end talks to an EngineCore: a blocking client (LLMEngine) and an asyncio
one (AsyncLLM), each with only the methods its caller can use."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvserve.config import EngineConfig
from kvserve.protocol.engine_core import EngineCoreOutputs, EngineCoreRequest, SchedulerStats

if TYPE_CHECKING:
    from kvserve.executor.abstract import Executor


class EngineCoreClient(ABC):
    """The blocking client LLMEngine drives: the core in this thread (InprocClient) or in
    a background process (SyncMPClient). AsyncLLM's client is AsyncEngineCoreClient."""

    # The core's objects live in this process (they are counted once, see request_census).
    runs_core_in_process: bool = False

    @staticmethod
    def make_client(
        config: EngineConfig,
        log_stats: bool = True,
        *,
        multiprocess_mode: bool = False,
        while_starting: Callable[[], object] | None = None,
    ) -> EngineCoreClient:
        """In-process core, or a core in a background process.

        ``while_starting`` (front-end setup) runs while a background core loads its model,
        or, for the in-process core, before it."""
        if config.parallel_config.front_end_balances:
            # Several cores: each in a process of its own, whatever multiprocess_mode says.
            from kvserve.engine.dp_client import DPClient

            return DPClient(config, log_stats, while_starting=while_starting)
        if multiprocess_mode:
            # Imported here: mp_client imports this module.
            from kvserve.engine.mp_client import SyncMPClient

            return SyncMPClient(config, log_stats, while_starting=while_starting)
        if while_starting is not None:
            while_starting()
        # The one import of the core (and torch) in the front end: the in-process client
        # hosts the core here (.importlinter names this edge).
        from kvserve.engine.inproc_client import InprocClient

        return InprocClient(config, log_stats)

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Requests that go to one core together (a parent's n > 1 children)."""
        for request in requests:
            self.add_request(request)

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs: ...

    @abstractmethod
    def reset_prefix_cache(self) -> bool: ...

    @abstractmethod
    def request_census(self) -> dict[str, dict[str, int]]:
        """The core's per-request census, by process (EngineCore.request_census)."""

    @abstractmethod
    def sleep(self, level: int) -> bool:
        """EngineCore.sleep: frees the KV cache (and the weights, level 2)."""

    @abstractmethod
    def wake_up(self, tags: list[str] | None) -> bool:
        """EngineCore.wake_up; returns whether some tag still sleeps."""

    @abstractmethod
    def is_sleeping(self) -> bool: ...

    @abstractmethod
    def in_process_executor(self) -> Executor:
        """The core's executor, for collective_rpc: only a core in this process has one
        to give (ValueError otherwise)."""

    @abstractmethod
    def shutdown(self) -> None: ...


class AsyncEngineCoreClient(ABC):
    """The asyncio client AsyncLLM drives (AsyncMPClient: the core in its own process)."""

    dead_reason: str | None

    @abstractmethod
    def is_alive(self) -> bool: ...

    @abstractmethod
    async def add_request_async(self, request: EngineCoreRequest) -> None: ...

    async def add_requests_async(self, requests: list[EngineCoreRequest]) -> None:
        """Requests that go to one core together (a parent's n > 1 children)."""
        for request in requests:
            await self.add_request_async(request)

    @abstractmethod
    async def abort_requests_async(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    async def get_output_async(self) -> EngineCoreOutputs: ...

    @abstractmethod
    async def reset_prefix_cache_async(self) -> bool: ...

    @abstractmethod
    async def get_stats_async(self) -> SchedulerStats: ...

    @abstractmethod
    async def request_census_async(self) -> dict[str, dict[str, int]]: ...

    @abstractmethod
    async def sleep_async(self, level: int) -> bool: ...

    @abstractmethod
    async def wake_up_async(self, tags: list[str] | None) -> bool: ...

    @abstractmethod
    async def is_sleeping_async(self) -> bool: ...

    @abstractmethod
    def shutdown(self) -> None: ...
