"""UniProcExecutor: one Worker in the engine's own process; an RPC is a method call.

With async scheduling the worker runs on a thread of its own, and every call to it
(steps and other RPCs alike, in the order they are made) goes through that thread: the
engine core schedules step N+1 and applies step N's output while N's forward runs there
(torch's kernels, kvserve's C++ ones included, run without the GIL). Without it, calls
run inline on the caller's thread.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, Protocol, TypeVar, overload

import torch

from kvserve.executor.abstract import Executor
from kvserve.executor.serial_utils import resolve_function
from kvserve.protocol.runner_output import ModelRunnerOutput
from kvserve.protocol.scheduler_output import GrammarOutput, SchedulerOutput
from kvserve.worker.worker import Worker

T = TypeVar("T")


class _Calls(Protocol):
    def submit(self, fn: Callable[[], T], /) -> Future[T]: ...

    def shutdown(self, wait: bool = True) -> None: ...


class _InlineCalls:
    """Runs each call at once on the caller's thread (synchronous steps)."""

    def submit(self, fn: Callable[[], T], /) -> Future[T]:
        future: Future[T] = Future()
        try:
            future.set_result(fn())
        except Exception as e:
            future.set_exception(e)
        return future

    def shutdown(self, wait: bool = True) -> None:
        return None


def _worker_thread() -> ThreadPoolExecutor:
    # The thread's intra-op thread count starts as this one's (torch keeps it per thread).
    return ThreadPoolExecutor(
        1,
        thread_name_prefix="kvserve-worker",
        initializer=torch.set_num_threads,
        initargs=(torch.get_num_threads(),),
    )


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self.async_scheduling = self.config.scheduler_config.async_scheduling
        self._calls: _Calls = _worker_thread() if self.async_scheduling else _InlineCalls()
        # Built and loaded on the thread that runs its steps: the model's parallel regions
        # then all start from that thread, so OpenMP keeps one team of workers. A second
        # team (the caller's, from loading) would make libgomp count more threads than
        # cores and cut its barrier spin short, and the decode step's barriers would sleep.
        self.driver_worker = self._calls.submit(self._load_worker).result()
        # The last step's execute_model: its sample_tokens fails with its error.
        self._last_execute: Future[Any] | None = None
        self._shut_down = False

    def _load_worker(self) -> Worker:
        worker = Worker(self.config, rank=0, local_rank=0)
        worker.init_device()
        worker.load_model()
        return worker

    @property
    def max_concurrent_batches(self) -> int:
        """Async scheduling: step N+1 is sent while step N runs."""
        return 2 if self.async_scheduling else 1

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if isinstance(method, str) and ":" not in method:  # every engine step's path
            bound = getattr(self.driver_worker, method)
            future = self._calls.submit(lambda: [bound(*args, **kwargs)])
        else:
            fn = resolve_function(method) if isinstance(method, str) else method
            future = self._calls.submit(lambda: [fn(self.driver_worker, *args, **kwargs)])
        # In-process calls cannot be interrupted, so `timeout` bounds only the wait.
        return future if non_block else future.result(timeout)

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> Future[Any] | None:
        worker = self.driver_worker
        future = self._calls.submit(lambda: worker.execute_model(scheduler_output))
        self._last_execute = future
        if non_block:
            return future
        future.result()
        return None

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
        execute, self._last_execute = self._last_execute, None
        worker = self.driver_worker

        def sample() -> ModelRunnerOutput:
            if execute is not None:
                execute.result()  # the forward's error is the step's
            return worker.sample_tokens(grammar_output)

        future = self._calls.submit(sample)
        return future if non_block else future.result()

    def shutdown(self) -> None:
        if not self._shut_down:
            self._shut_down = True
            try:  # after the calls before it: a step in flight ends first
                self._calls.submit(self.driver_worker.shutdown).result()
            finally:
                self._calls.shutdown()
