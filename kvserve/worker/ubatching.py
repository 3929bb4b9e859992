"""Micro-batch forwards that take turns (vLLM's UBatchContext and its threads).

Each micro-batch's forward runs in a thread of its own, but only the holder of a baton
runs: at every tensor-parallel all-reduce the holder issues the reduction asynchronously
and hands the baton on, so the other micro-batch computes while the reduction travels;
when the baton comes back it waits for its reduction (done by then, or nearly) and goes
on. Every rank cuts the same step the same way and passes the baton at the same
collectives, so all ranks issue their collectives in the same order, which
torch.distributed requires.

Only one thread computes at a time: the overlap is of communication with compute, as in
vLLM, and the model code (and the forward context it reads, which the holder installs)
sees one micro-batch at a time.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from kvserve.forward_context import ForwardContext, UBatchContext, override_forward_context

T = TypeVar("T")


class UBatchBaton:
    """Which micro-batch may run; the others wait. Micro-batch 0 starts."""

    def __init__(self, num_ubatches: int) -> None:
        self._cond = threading.Condition()
        self._holder = 0
        self._running = [True] * num_ubatches

    def take(self, index: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._holder == index)

    def pass_on(self, index: int) -> None:
        """To the next micro-batch still running (``index`` keeps it when none is)."""
        with self._cond:
            n = len(self._running)
            for step in range(1, n + 1):
                if self._running[(index + step) % n]:
                    self._holder = (index + step) % n
                    break
            self._cond.notify_all()

    def finish(self, index: int) -> None:
        with self._cond:
            self._running[index] = False
        self.pass_on(index)


class PingPongUBatch(UBatchContext):
    """One micro-batch's place in the turns: its collectives overlap the others' work."""

    def __init__(self, index: int, baton: UBatchBaton) -> None:
        self.index = index
        self.baton = baton
        self.forward_context: ForwardContext | None = None

    def take_turn(self) -> None:
        self.baton.take(self.index)
        override_forward_context(self.forward_context)

    def overlap(self, start: Callable[[bool], Any]) -> None:
        work = start(True)
        self.baton.pass_on(self.index)
        self.take_turn()
        work.wait()


class UBatchThreads:
    """Runs micro-batch forwards in turns: the first in the calling thread, the second in
    a kept thread (a thread per step would cost its start-up every step)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-ubatch")

    def run(
        self,
        outer: ForwardContext,
        attn_metadata: Sequence[Any],
        forwards: Sequence[Callable[[], T]],
    ) -> list[T]:
        """Each forward under a copy of ``outer`` with its micro-batch's attention
        metadata; ``outer`` is installed again at the end."""
        if len(forwards) != 2:
            raise ValueError(f"dual batch overlap runs 2 micro-batches, got {len(forwards)}")
        baton = UBatchBaton(len(forwards))
        ubatches = [PingPongUBatch(i, baton) for i in range(len(forwards))]
        for ubatch, metadata in zip(ubatches, attn_metadata, strict=True):
            ubatch.forward_context = dataclasses.replace(
                outer, attn_metadata=metadata, ubatch=ubatch
            )
        # Thread-local torch state the second thread must share with this one.
        num_threads, inference = torch.get_num_threads(), torch.is_inference_mode_enabled()

        def second() -> T:
            torch.set_num_threads(num_threads)
            with torch.inference_mode(inference):
                return _take_turns(ubatches[1], forwards[1])

        future = self._pool.submit(second)
        try:
            first = _take_turns(ubatches[0], forwards[0])
        finally:
            # The second runs to its end in any case: its collectives pair with the
            # other ranks', which do not know this one failed.
            try:
                last = future.result()
            finally:
                override_forward_context(outer)
        return [first, last]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)


def _take_turns(ubatch: PingPongUBatch, forward: Callable[[], T]) -> T:
    ubatch.take_turn()
    try:
        return forward()
    finally:
        ubatch.baton.finish(ubatch.index)
