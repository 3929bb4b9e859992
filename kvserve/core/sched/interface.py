"""What an engine core needs from a scheduler."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.core.request import Request, RequestStatus
    from kvserve.protocol.engine_core import EngineCoreOutputs, SchedulerStats
    from kvserve.protocol.runner_output import ModelRunnerOutput
    from kvserve.protocol.scheduler_output import SchedulerOutput


class SchedulerInterface(ABC):
    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Decides what runs in the next step, within the token budget and the KV cache."""

    @abstractmethod
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Applies one step's sampled tokens; call it after every schedule(), even an empty one."""

    @abstractmethod
    def add_request(self, request: Request) -> None: ...

    @abstractmethod
    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        """Finishes requests from outside (abort); unknown ids are ignored."""

    @abstractmethod
    def get_num_unfinished_requests(self) -> int: ...

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    @abstractmethod
    def has_finished_requests(self) -> bool:
        """Whether finished requests still have to be reported to the workers."""

    def has_requests(self) -> bool:
        """Whether a step has anything to do."""
        return self.has_unfinished_requests() or self.has_finished_requests()

    @abstractmethod
    def reset_prefix_cache(self) -> bool: ...

    @abstractmethod
    def make_stats(self) -> SchedulerStats | None: ...

    @abstractmethod
    def shutdown(self) -> None: ...
