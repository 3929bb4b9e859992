"""The engine core's batch queue (vLLM's ``step_with_batch_queue``).

With pipeline parallelism one step's micro-batch passes through the stages one after
another: run a step at a time and every stage but one idles. When the executor can keep
several batches in flight (``max_concurrent_batches``, the number of stages) the core
schedules the next micro-batch as soon as one is sent, without waiting for its tokens;
the workers take their calls in order, so the first stage starts on batch k+1 while the
last one still runs batch k. Outputs are applied oldest first. The scheduler keeps a
request out of every batch but the one it is in flight in (core/sched/in_flight.py).
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.executor.abstract import ExecutorFailedError
from kvserve.protocol.engine_core import EngineCoreOutputs, StepTimes

if TYPE_CHECKING:
    from kvserve.core.sched.scheduler import Scheduler
    from kvserve.executor.abstract import Executor
    from kvserve.protocol.runner_output import ModelRunnerOutput
    from kvserve.protocol.scheduler_output import SchedulerOutput
    from kvserve.structured_output.manager import StructuredOutputManager


@dataclass
class InFlightBatch:
    scheduler_output: SchedulerOutput
    output: Future[ModelRunnerOutput]


class EngineCoreBatchQueueMixin:
    # Provided by EngineCore.
    scheduler: Scheduler
    model_executor: Executor
    structured_output_manager: StructuredOutputManager
    step_times: StepTimes | None

    if TYPE_CHECKING:

        def _fail_step(
            self, scheduler_output: SchedulerOutput, error: Exception
        ) -> EngineCoreOutputs: ...
        def _publish_kv_events(self) -> None: ...
        def _count_model_step(
            self, model_output: ModelRunnerOutput, outputs: EngineCoreOutputs
        ) -> None: ...

    def _init_batch_queue(self, max_concurrent_batches: int) -> None:
        self.batch_queue_size = max_concurrent_batches
        # None: one step at a time (EngineCore.step's own path).
        self.batch_queue: deque[InFlightBatch] | None = (
            deque() if max_concurrent_batches > 1 else None
        )
        # The most batches with tokens seen in flight at once (tests and benchmarks).
        self.max_batches_in_flight = 0

    def has_work(self) -> bool:
        """Whether a step has anything to do: requests, or batches still in flight."""
        return self.scheduler.has_requests() or bool(self.batch_queue)

    def step_with_batch_queue(self) -> tuple[EngineCoreOutputs, bool]:
        """Sends a new micro-batch if the queue has room and the scheduler has one;
        otherwise (or if the oldest batch is back already) applies the oldest batch's
        output. Returns the outputs (empty when none came back) and whether one was sent."""
        queue = self.batch_queue
        assert queue is not None
        start = time.perf_counter()
        sent = False
        if len(queue) < self.batch_queue_size and self.scheduler.has_requests():
            scheduler_output = self.scheduler.schedule()
            scheduled = time.perf_counter()
            if self.step_times is not None:
                self.step_times.schedule += scheduled - start
            sent = scheduler_output.total_num_scheduled_tokens > 0
            if not sent and not queue:
                self.structured_output_manager.wait_for_compiles(timeout=0.01)
            if sent or not queue or _tells_workers(scheduler_output):
                self._send_batch(scheduler_output)
                self.max_batches_in_flight = max(
                    self.max_batches_in_flight,
                    sum(1 for b in queue if b.scheduler_output.total_num_scheduled_tokens),
                )
        outputs = EngineCoreOutputs(timestamp=time.monotonic())
        if queue and (not sent or queue[0].output.done()):
            outputs = self._apply_oldest(queue.popleft())
        if self.step_times is not None:
            self.step_times.busy += time.perf_counter() - start
        return outputs, sent

    def _send_batch(self, scheduler_output: SchedulerOutput) -> None:
        assert self.batch_queue is not None
        try:
            self.model_executor.execute_model(scheduler_output, non_block=True)
            grammar_output = self.scheduler.get_grammar_bitmask(scheduler_output)
            output = self.model_executor.sample_tokens(grammar_output, non_block=True)
        except ExecutorFailedError:
            raise
        except Exception as e:  # e.g. a bitmask that failed: the batch fails alone
            output = Future()
            output.set_exception(e)
        self.batch_queue.append(InFlightBatch(scheduler_output, output))

    def _apply_oldest(self, batch: InFlightBatch) -> EngineCoreOutputs:
        try:
            model_output = batch.output.result()
            started = time.perf_counter()
            outputs = self.scheduler.update_from_output(batch.scheduler_output, model_output)
        except ExecutorFailedError:
            raise  # a worker is gone: no request is to blame and no retry can succeed
        except Exception as e:
            return self._fail_step(batch.scheduler_output, e)
        if self.step_times is not None:
            self.step_times.update += time.perf_counter() - started
            self._count_model_step(model_output, outputs)
        outputs.timestamp = time.monotonic()
        self._publish_kv_events()
        return outputs


def _tells_workers(scheduler_output: SchedulerOutput) -> bool:
    """Whether a batch without tokens still carries news the workers must get."""
    return bool(
        scheduler_output.finished_req_ids
        or scheduler_output.preempted_req_ids
        or scheduler_output.free_encoder_mm_hashes
        or scheduler_output.kv_connector_metadata is not None
    )
