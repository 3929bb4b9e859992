"""StepResults: the scheduler's side of a step that came back, or failed.

update_from_output applies the step's tokens, the KV connector's report and the encoder's
stats; isolate_failed_step rolls a failed step back and lets the FailureIsolator judge
it. Each request's share of a step is applied under a guard: an exception while applying
one request ends that request alone with "error", and the others go on.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvserve.core.request import Request, RequestStatus
from kvserve.core.sched.scheduler_checks import evict_step_blocks, undo_partial_update
from kvserve.core.sched.utils import check_stop, make_engine_core_output
from kvserve.protocol.engine_core import EngineCoreOutput

if TYPE_CHECKING:
    from kvserve.core.kv_cache_manager import KVCacheManager
    from kvserve.core.sched.encoder_planner import NoEncoderPlanner
    from kvserve.core.sched.failure_isolator import FailureIsolator
    from kvserve.core.sched.grammar_tracker import GrammarTracker
    from kvserve.core.sched.in_flight import InFlightBatches
    from kvserve.core.sched.kv_transfer_planner import NoKVTransfer
    from kvserve.core.sched.request_releaser import RequestReleaser
    from kvserve.core.sched.request_table import RequestTable
    from kvserve.core.sched.spec_decode_tracker import SpecDecodeTracker
    from kvserve.protocol.runner_output import ModelRunnerOutput
    from kvserve.protocol.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


class StepResults:
    def __init__(
        self,
        table: RequestTable,
        releaser: RequestReleaser,
        kv_cache_manager: KVCacheManager,
        kv_transfer: NoKVTransfer,
        encoder: NoEncoderPlanner,
        grammars: GrammarTracker,
        spec_decode: SpecDecodeTracker,
        batches: InFlightBatches,
        isolator: FailureIsolator,
        max_model_len: int,
    ) -> None:
        self.table = table
        self.releaser = releaser
        self.kv_cache_manager = kv_cache_manager
        self.kv_transfer = kv_transfer
        self.encoder = encoder
        self.grammars = grammars
        self.spec_decode = spec_decode
        self.batches = batches
        self.isolator = isolator
        self.max_model_len = max_model_len

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Applies a step's sampled tokens and the KV connector's report; returns the
        step's outputs (with those of requests ended since the last step first)."""
        # KV connector results first: a failed load voids (or, policy "fail", ends) a request.
        dropped, failed = self.kv_transfer.update_from_output(
            scheduler_output, model_runner_output.kv_connector_output, self.table.requests
        )
        for request, message in failed:
            self.releaser.fail(request, message)
        self.encoder.record(model_runner_output)
        outputs: list[EngineCoreOutput] = []
        stopped: list[Request] = []
        # Probe members that sampled clear their suspicion (only while isolating).
        sampled: list[str] | None = [] if self.isolator.is_isolating else None
        for request_id in scheduler_output.num_scheduled_tokens:
            live = self.table.get(request_id)
            if live is None or live.is_finished() or request_id in dropped:
                continue  # aborted while the step ran, or recomputes after a failed KV load
            request = live
            try:
                output = self._update_request(request, model_runner_output, scheduler_output)
            except Exception as error:
                self._fail_in_update(request, error)
                continue
            if output is not None:
                outputs.append(output)
                if sampled is not None and output.new_token_ids:
                    sampled.append(request_id)
                if output.finish_reason is not None:
                    stopped.append(request)
        self.table.remove(stopped)
        # Once its samples are taken (an async placeholder ends with its token).
        self.batches.release(scheduler_output)
        if sampled is not None:
            self.isolator.cleared(sampled)
        elif scheduler_output.total_num_scheduled_tokens:
            self.isolator.step_succeeded()
        # Taken last: should this method raise halfway, isolate_failed_step reports them.
        outputs[:0] = self.table.take_pending_outputs()
        return outputs

    def _update_request(
        self,
        request: Request,
        runner_output: ModelRunnerOutput,
        scheduler_output: SchedulerOutput,
    ) -> EngineCoreOutput | None:
        """Applies one request's share of the step; returns its output, if any."""
        request_id = request.request_id
        req_index = runner_output.req_id_to_index.get(request_id)
        scheduled_spec = scheduler_output.scheduled_spec_decode_tokens.get(request_id)
        if scheduled_spec is not None:
            num_generated = (
                0 if req_index is None else len(runner_output.sampled_token_ids[req_index])
            )
            self.spec_decode.apply_result(request, scheduled_spec, num_generated)
        new_token_ids: list[int] = []
        # A partial prefill samples nothing useful: only a caught-up request takes tokens.
        if req_index is not None and self.batches.takes_sample(scheduler_output, request):
            new_token_ids = list(runner_output.sampled_token_ids[req_index])
        is_stopped = False
        self.encoder.free_computed(request)
        pooled = runner_output.pooler_output.get(request_id)
        if pooled is not None:  # a pooling request is done once its prompt is
            new_token_ids = []  # and samples nothing
            request.status = RequestStatus.FINISHED_STOPPED
            is_stopped = True
        for i, token_id in enumerate(new_token_ids):
            request.append_output_token_ids(token_id)
            if check_stop(request, self.max_model_len) or self.grammars.advance(request, token_id):
                del new_token_ids[i + 1 :]
                is_stopped = True
                break
        output = make_engine_core_output(request, new_token_ids, runner_output, req_index)
        spec_token_ids = runner_output.spec_token_ids
        if not is_stopped and spec_token_ids is not None and req_index is not None:
            self.spec_decode.keep_drafts(request, spec_token_ids[req_index])
        if is_stopped:
            kv_transfer_params = self.releaser.free(request)
            assert output is not None  # a finished request always reports
            output.kv_transfer_params = kv_transfer_params
        if output is not None:
            output.pooling_output = pooled
        return output

    def _fail_in_update(self, request: Request, error: Exception) -> None:
        """Applying ``request``'s share of the step raised: it alone ends with the error.
        Tokens it appended were never reported; its final output is the error."""
        logger.exception("updating request %s failed: it ends with an error", request.request_id)
        self.releaser.fail(request, f"{type(error).__name__}: {error}")

    # ---- a failed step ---------------------------------------------------------------------

    def isolate_failed_step(
        self, scheduler_output: SchedulerOutput, message: str
    ) -> list[EngineCoreOutput]:
        """Blames a lone request, or turns the step's requests into suspects (see
        failure_isolator.py); returns the outputs of requests this ended (the culprit's,
        carrying ``message``)."""
        self.batches.release(scheduler_output)
        undo_partial_update(self.table, scheduler_output, self.kv_cache_manager.block_size, message)
        failed = [
            r
            for rid in scheduler_output.num_scheduled_tokens
            if (r := self.table.get(rid)) is not None and r.status == RequestStatus.RUNNING
        ]
        if self.kv_cache_manager.enable_caching:
            evict_step_blocks(self.kv_cache_manager, scheduler_output, failed)
        failed_ids = [r.request_id for r in failed]
        self.table.stop_running(set(failed_ids))
        culprit = self.isolator.step_failed(failed_ids)
        if culprit is not None:
            self.releaser.fail(failed[0], message)
        elif failed:
            # Suspects of the old probe that this step left out wait too: only the new
            # probe may run.
            idle = self.table.stop_running(
                self.isolator.idle_suspects(r.request_id for r in self.table.running)
            )
            for request in reversed(failed + idle):  # prepended one by one: keeps order
                self.releaser.preempt(request)
        return self.table.take_pending_outputs()

    def discard_step(self, scheduler_output: SchedulerOutput) -> None:
        """Async scheduling: a step sent on the placeholders of a step that then failed
        ran on tokens that never came. Nothing it did counts and no request is blamed
        for it: those of its requests still running (the failed step's own were dealt with
        by isolate_failed_step) recompute, and the blocks it cached ahead are evicted."""
        self.batches.release(scheduler_output)
        running = [
            r
            for rid in scheduler_output.num_scheduled_tokens
            if (r := self.table.get(rid)) is not None and r.status == RequestStatus.RUNNING
        ]
        if self.kv_cache_manager.enable_caching:
            evict_step_blocks(self.kv_cache_manager, scheduler_output, running)
        for request in reversed(self.table.stop_running({r.request_id for r in running})):
            self.releaser.preempt(request)
