"""The engine core in the caller's own process and thread (LLMEngine's default): no
process, no sockets; each get_output() is one step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.config import EngineConfig
from kvserve.engine.core_client import EngineCoreClient
from kvserve.engine_core.core import EngineCore
from kvserve.protocol.engine_core import EngineCoreOutputs, EngineCoreRequest

if TYPE_CHECKING:
    from kvserve.executor.abstract import Executor


class InprocClient(EngineCoreClient):
    """Runs the core in the caller's thread: get_output() performs one step."""

    runs_core_in_process = True

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

    def request_census(self) -> dict[str, dict[str, int]]:
        return self.engine_core.request_census()

    def sleep(self, level: int) -> bool:
        return self.engine_core.sleep(level)

    def wake_up(self, tags: list[str] | None) -> bool:
        return self.engine_core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine_core.is_sleeping()

    def in_process_executor(self) -> Executor:
        # Called between steps: this thread runs both the steps and the call.
        return self.engine_core.model_executor

    def shutdown(self) -> None:
        self.engine_core.shutdown()
