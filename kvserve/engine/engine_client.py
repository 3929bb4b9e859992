"""EngineClient: what an async front end (the OpenAI server) needs from an engine."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvserve.config import EngineConfig, ModelConfig
    from kvserve.inputs import PromptType
    from kvserve.lora.request import LoRARequest
    from kvserve.metrics.loggers import StatLoggerBase
    from kvserve.outputs import PoolingRequestOutput, RequestOutput
    from kvserve.pooling_params import PoolingParams
    from kvserve.protocol.engine_core import SchedulerStats
    from kvserve.sampling_params import SamplingParams


class EngineClient(ABC):
    config: EngineConfig
    model_config: ModelConfig
    # The HF tokenizer the engine tokenizes and detokenizes with.
    tokenizer: Any

    @property
    @abstractmethod
    def is_running(self) -> bool: ...

    @property
    @abstractmethod
    def errored(self) -> bool: ...

    @property
    @abstractmethod
    def dead_error(self) -> BaseException: ...

    @abstractmethod
    def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Streams the request's outputs; ValueError for bad input before the first one,
        EngineDeadError if the engine dies. Closing or cancelling the iterator aborts it."""

    @abstractmethod
    def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        *,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """A pooling request: its one output carries the prompt's vector."""

    @abstractmethod
    async def abort(self, request_id: str | Iterable[str]) -> None: ...

    @abstractmethod
    async def check_health(self) -> None:
        """Raises EngineDeadError if the engine can no longer serve."""

    @abstractmethod
    async def reset_prefix_cache(self) -> bool: ...

    @abstractmethod
    async def get_scheduler_stats(self) -> SchedulerStats: ...

    @abstractmethod
    async def sleep(self, level: int = 1) -> None:
        """Frees the KV cache (and the weights, level 2); EngineBusyError with requests
        in flight; generate() raises EngineSleepingError until wake_up."""

    @abstractmethod
    async def wake_up(self, tags: list[str] | None = None) -> None: ...

    @abstractmethod
    async def is_sleeping(self) -> bool: ...

    @property
    @abstractmethod
    def sleeping(self) -> bool:
        """Whether the engine slept as of its last sleep or wake_up (no core round trip)."""
        ...

    @abstractmethod
    async def request_census(self) -> dict[str, dict[str, int]]:
        """Per process, every owner's live per-request entries (utils/census.py)."""

    @abstractmethod
    def add_stat_logger(self, stat_logger: StatLoggerBase) -> None:
        """Feeds ``stat_logger`` every stats record from now on, beside the engine's own
        loggers (e.g. the web dashboard's history); nothing reaches it if stats are off."""

    async def get_tokenizer(self) -> Any:
        return self.tokenizer

    @abstractmethod
    def shutdown(self) -> None: ...
