"""How the front end talks to an EngineCore: a blocking client (LLMEngine) and an asyncio
one (AsyncLLM), each with only the methods its caller can use."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvserve.config import EngineConfig
from kvserve.protocol.engine_core import EngineCoreOutputs, EngineCoreRequest, SchedulerStats

if TYPE_CHECKING:
    # Only the in-process client builds a core: the multi-process clients import this
    # module in the front end, which must not import torch before it spawns the core.
    from kvserve.engine.core import EngineCore


class EngineCoreClient(ABC):
    """The blocking client LLMEngine drives: the core in this thread (InprocClient) or in
    a background process (SyncMPClient). AsyncLLM's client is AsyncEngineCoreClient."""

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
        if multiprocess_mode:
            # Imported here: mp_client imports this module.
            from kvserve.engine.mp_client import SyncMPClient

            return SyncMPClient(config, log_stats, while_starting=while_starting)
        if while_starting is not None:
            while_starting()
        return InprocClient(config, log_stats)

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs: ...

    @abstractmethod
    def reset_prefix_cache(self) -> bool: ...

    @abstractmethod
    def shutdown(self) -> None: ...


class AsyncEngineCoreClient(ABC):
    """The asyncio client AsyncLLM drives (AsyncMPClient: the core in its own process)."""

    dead_reason: str | None

    @abstractmethod
    def is_alive(self) -> bool: ...

    @abstractmethod
    async def add_request_async(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    async def abort_requests_async(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    async def get_output_async(self) -> EngineCoreOutputs: ...

    @abstractmethod
    async def reset_prefix_cache_async(self) -> bool: ...

    @abstractmethod
    async def get_stats_async(self) -> SchedulerStats: ...

    @abstractmethod
    def shutdown(self) -> None: ...


class InprocClient(EngineCoreClient):
    """Runs the core in the caller's thread: get_output() performs one step."""

    def __init__(self, config: EngineConfig, log_stats: bool = True) -> None:
        from kvserve.engine.core import EngineCore

        self.engine_core: EngineCore = EngineCore(config, log_stats=log_stats)
        self.engine_core.settle_heap()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        outputs, _ = self.engine_core.step()
        return outputs

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
