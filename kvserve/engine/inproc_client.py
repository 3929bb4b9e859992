"""The engine core in the caller's own process and thread (LLMEngine's default): no
process, no sockets; each get_output() is one step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvserve.config import EngineConfig
from kvserve.engine.core_client import EngineCoreClient
from kvserve.engine_core.core import EngineCore
from kvserve.protocol.engine_core import EngineCoreOutputs, EngineCoreRequest


class InprocClient(EngineCoreClient):
    """Runs the core in the caller's thread: get_output() performs one step."""

    def __init__(self, config: EngineConfig, log_stats: bool = True) -> None:
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
        timeout: float | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
    ) -> list[Any]:
        # Between steps: this thread runs both the steps and this call.
        executor = self.engine_core.model_executor
        return list(executor.collective_rpc(method, timeout, args, kwargs))

    def shutdown(self) -> None:
        self.engine_core.shutdown()
