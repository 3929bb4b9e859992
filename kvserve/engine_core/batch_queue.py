"""The engine core's batch queue (vLLM's ``step_with_batch_queue``); every step goes
through it, and a plain step is a queue of depth 1.

With pipeline parallelism one step's micro-batch passes through the stages one after
another: run a step at a time and every stage but one idles. When the executor can keep
several batches in flight (``max_concurrent_batches``, the number of stages) the core
schedules the next micro-batch as soon as one is sent, without waiting for its tokens;
the workers take their calls in order, so the first stage starts on batch k+1 while the
last one still runs batch k. Outputs are applied oldest first, and once the queue is
full the core waits for the oldest. The scheduler keeps a request out of every batch but
the one it is in flight in (core/sched/in_flight.py).

Async scheduling uses the same queue at depth 2 with one worker on its own thread
(executor/uniproc_executor.py): step N+1 is scheduled and sent while N runs, its requests'
tokens from N still placeholders, and N's output is applied (and, served, sent to the
front end) while N+1 runs.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.executor.abstract import ExecutorFailedError

if TYPE_CHECKING:
    from kvserve.core.sched.scheduler import Scheduler
    from kvserve.executor.abstract import Executor
    from kvserve.protocol.runner_output import ModelRunnerOutput
    from kvserve.protocol.scheduler_output import SchedulerOutput


@dataclass
class InFlightBatch:
    scheduler_output: SchedulerOutput
    output: Future[ModelRunnerOutput]


class BatchQueue:
    """The only owner of the batches sent to the executor and not yet applied."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.batches: deque[InFlightBatch] = deque()
        # The most batches with tokens seen in flight at once (tests and benchmarks).
        self.max_batches_in_flight = 0

    def __bool__(self) -> bool:
        return bool(self.batches)

    def has_room(self) -> bool:
        return len(self.batches) < self.size

    def send(
        self, scheduler_output: SchedulerOutput, executor: Executor, scheduler: Scheduler
    ) -> None:
        """Starts the step on the executor; a step that fails to start fails alone when
        its output is applied."""
        output: Future[ModelRunnerOutput]
        try:
            executor.execute_model(scheduler_output, non_block=True)
            grammar_output = scheduler.get_grammar_bitmask(scheduler_output)
            output = executor.sample_tokens(grammar_output, non_block=True)
        except ExecutorFailedError:
            raise  # a worker is gone: no request is to blame and no retry can succeed
        except Exception as e:  # e.g. a bitmask that failed: the batch fails alone
            output = Future()
            output.set_exception(e)
        self.batches.append(InFlightBatch(scheduler_output, output))
        in_flight = sum(1 for b in self.batches if b.scheduler_output.total_num_scheduled_tokens)
        self.max_batches_in_flight = max(self.max_batches_in_flight, in_flight)

    def oldest_due(self, sent: bool) -> bool:
        """Whether to apply the oldest batch now: nothing new was sent, the queue is full
        (nothing else can be done meanwhile), or its output is back already."""
        return bool(self.batches) and (
            not sent or not self.has_room() or self.batches[0].output.done()
        )

    def pop_oldest(self) -> InFlightBatch:
        return self.batches.popleft()


def tells_workers(scheduler_output: SchedulerOutput) -> bool:
    """Whether a batch without tokens still carries news the workers must get."""
    return bool(
        scheduler_output.finished_req_ids
        or scheduler_output.preempted_req_ids
        or scheduler_output.free_encoder_mm_hashes
        or scheduler_output.kv_connector_metadata is not None
    )
