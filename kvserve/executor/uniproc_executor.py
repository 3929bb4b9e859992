"""UniProcExecutor: one Worker in the engine's own process; an RPC is a method call."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kvserve.executor.abstract import Executor
from kvserve.executor.serial_utils import resolve_function
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
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        # In-process calls cannot be interrupted, so `timeout` has nothing to bound.
        kwargs = kwargs or {}
        if not non_block:
            if isinstance(method, str) and ":" not in method:  # every engine step's path
                return [getattr(self.driver_worker, method)(*args, **kwargs)]
            fn = resolve_function(method) if isinstance(method, str) else method
            return [fn(self.driver_worker, *args, **kwargs)]
        future: Future[list[Any]] = Future()
        try:
            future.set_result(self.collective_rpc(method, timeout, args, kwargs))
        except Exception as e:
            future.set_exception(e)
        return future

    def shutdown(self) -> None:
        if not self._shut_down:
            self._shut_down = True
            self.driver_worker.shutdown()
