"""UniProcExecutor: one Worker in the engine's own process; an RPC is a method call.

With async scheduling the worker runs on a thread of its own, and every call to it
(steps and other RPCs alike, in the order they are made) goes through that thread: the
engine core schedules step N+1 and applies step N's output while N's forward runs there
(torch's kernels, kvserve's C++ ones included, run without the GIL: the fused decode
stack, a TorchScript class method, is called through torch's script-method binding,
which releases it; `py-spy record --gil` shows the worker holding the GIL in 8 of 1,624
samples inside it). Without it, calls run inline on the caller's thread.

The model's OpenMP team belongs to the worker's thread alone (``_WorkerThread``): the
engine core's thread ends the team it may have and keeps one intra-op thread while the
worker is on its own. libgomp gives every thread that starts a parallel region a team
of its own, and once their threads together outnumber the cores it cuts every barrier's
spin from GOMP_SPINCOUNT to 1,000 rounds, so the fused decode step's 180 barriers a
token sleep and wake through the kernel (OMP_WAIT_POLICY=PASSIVE's cost on a quiet
machine, utils/threads.py). Before, two teams ran in every async engine: one
`torch.full` on the core's thread made the second (the structured-output bitmask,
allocated when the core starts; found with a breakpoint on GOMP_parallel), and in
`kvserve bench peers` the GEMM rate measured on the main thread first made it already.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, Protocol, TypeVar, overload

import torch

from kvserve.executor.abstract import Executor
from kvserve.executor.serial_utils import resolve_function
from kvserve.protocol.runner_output import ModelRunnerOutput
from kvserve.protocol.scheduler_output import GrammarOutput, SchedulerOutput
from kvserve.utils.threads import release_openmp_team
from kvserve.worker.worker import Worker

logger = logging.getLogger(__name__)

T = TypeVar("T")


class _Calls(Protocol):
    def submit(self, fn: Callable[[], T], /) -> Future[T]: ...

    def shutdown(self, wait: bool = True) -> None: ...


class _Completed(Future[T]):
    """A future born done, with the call's result or error. A plain Future builds a
    Condition (an RLock) and takes it to settle and to read: ~10 us per future on a loaded
    Zen 3, two per synchronous step, for a value that is known before the future exists.
    Nothing waits on an inline call's future, so it needs no lock."""

    def __init__(self, value: T | None, error: BaseException | None) -> None:
        # Future.__init__ is skipped on purpose: its lock and waiter list serve only
        # futures that are still pending, and every method that reads them is overridden.
        self._value = value
        self._error = error

    def done(self) -> bool:
        return True

    def running(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def cancel(self) -> bool:
        return False

    def result(self, timeout: float | None = None) -> T:
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._error

    def add_done_callback(self, fn: Callable[[Future[T]], object]) -> None:
        # As Future does for a done future: a failing callback is logged, not raised.
        try:
            fn(self)
        except Exception:
            logger.exception("exception calling callback for %r", self)

    def __repr__(self) -> str:  # Future's reads the lock this one does not have
        outcome = "raised " + type(self._error).__name__ if self._error else "finished"
        return f"<_Completed at {id(self):#x} state={outcome}>"

    def set_result(self, result: T) -> None:
        raise RuntimeError("an inline call's future is settled when it is made")

    def set_exception(self, exception: BaseException | None) -> None:
        raise RuntimeError("an inline call's future is settled when it is made")


class _InlineCalls:
    """Runs each call at once on the caller's thread (synchronous steps)."""

    def submit(self, fn: Callable[[], T], /) -> Future[T]:
        try:
            return _Completed(fn(), None)
        except Exception as e:
            return _Completed(None, e)

    def shutdown(self, wait: bool = True) -> None:
        return None


class _WorkerThread:
    """Runs each call on one thread of its own, in the order they come (async
    scheduling). The thread takes the caller's intra-op thread count, and the caller
    keeps one until shutdown: torch's thread count is per thread, and any parallel op on
    the caller's side (a fill, a copy above torch's grain size) would start a second
    OpenMP team, whose threads would make libgomp throttle the model's barriers."""

    def __init__(self) -> None:
        self._caller = threading.get_ident()
        self._caller_threads = torch.get_num_threads()
        # A team the caller made before (loading another engine, measuring a GEMM, the
        # user's own work) would count against the worker's as much as a new one.
        release_openmp_team()
        self._pool = ThreadPoolExecutor(
            1,
            thread_name_prefix="kvserve-worker",
            initializer=torch.set_num_threads,
            initargs=(self._caller_threads,),
        )
        torch.set_num_threads(1)

    def submit(self, fn: Callable[[], T], /) -> Future[T]:
        return self._pool.submit(fn)

    def shutdown(self, wait: bool = True) -> None:
        self._pool.shutdown(wait)
        if threading.get_ident() == self._caller:  # the count is the caller thread's own
            torch.set_num_threads(self._caller_threads)


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self.async_scheduling = self.config.scheduler_config.async_scheduling
        self._calls: _Calls = _WorkerThread() if self.async_scheduling else _InlineCalls()
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
