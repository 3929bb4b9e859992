"""UniProcExecutor: one Worker in the engine's own process; an RPC is a method call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvserve.executor.abstract import Executor
from kvserve.worker.worker import Worker


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self.driver_worker = Worker(self.config, rank=0, local_rank=0)
        self.driver_worker.init_device()
        self.driver_worker.load_model()
        self._shut_down = False

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        # In-process calls cannot be interrupted, so `timeout` has nothing to bound.
        kwargs = kwargs or {}
        if isinstance(method, str):
            return [getattr(self.driver_worker, method)(*args, **kwargs)]
        return [method(self.driver_worker, *args, **kwargs)]

    def shutdown(self) -> None:
        if not self._shut_down:
            self._shut_down = True
            self.driver_worker.shutdown()
