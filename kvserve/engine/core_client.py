"""EngineCoreClient: how the front end talks to an EngineCore (in-process for now)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvserve.config import EngineConfig
from kvserve.protocol.engine_core import EngineCoreOutputs, EngineCoreRequest

if TYPE_CHECKING:
    # Only the in-process client builds a core: the multi-process clients import this
    # module in the front end, which must not import torch before it spawns the core.
    from kvserve.engine.core import EngineCore


class EngineCoreClient(ABC):
    @staticmethod
    def make_client(
        config: EngineConfig,
        log_stats: bool = True,
        *,
        multiprocess_mode: bool = False,
        asyncio_mode: bool = False,
        while_starting: Callable[[], object] | None = None,
    ) -> Any:
        """In-process core, or a core in a background process (sync or asyncio client).

        ``while_starting`` (front-end setup) runs while a background core loads its model,
        or, for the in-process core, before it."""
        # Imported here: the multi-process clients import this module.
        if asyncio_mode:
            from kvserve.engine.async_mp_client import AsyncMPClient

            return AsyncMPClient(config, log_stats, while_starting=while_starting)
        if multiprocess_mode:
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

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        # A callable and arbitrary arguments reach another process only as pickles, which
        # kvserve never sends; the in-process core calls the worker directly.
        raise ValueError(
            "collective_rpc needs the engine core in this process "
            "(LLM(..., multiprocess_mode=False), the default)"
        )


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

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        return self.engine_core.collective_rpc(method, timeout, args, kwargs)

    def shutdown(self) -> None:
        self.engine_core.shutdown()
