"""vLLM v1's scheduler: one token budget shared by prefills and decodes.

Every request has num_computed_tokens catching up to num_tokens. Each step first
serves the RUNNING requests (decodes and unfinished prefill chunks), preempting by
recompute when the KV cache runs out, then admits WAITING ones (after prefix-cache
hits) while budget, max_num_seqs and free blocks last.

The Scheduler decides; its collaborators own the state, each the only writer of its
own: the RequestTable (waiting, running, finished), the KVCacheManager (blocks), the
StepPlan (one step's grants), the KV-transfer and encoder planners, the grammar and
spec-decode trackers, the in-flight batches and the FailureIsolator. A feature that is
off has a no-op collaborator, so the loops below never ask whether it exists.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.sched.encoder_planner import EncoderPlanner, NoEncoderPlanner
from kvserve.core.sched.failure_isolator import FailureIsolator
from kvserve.core.sched.grammar_tracker import GrammarTracker
from kvserve.core.sched.in_flight import InFlightBatches
from kvserve.core.sched.interface import SchedulerInterface
from kvserve.core.sched.kv_transfer_planner import KVTransferPlanner, NoKVTransfer
from kvserve.core.sched.request_queue import (
    RequestQueue,
    SchedulingPolicy,
    create_request_queue,
)
from kvserve.core.sched.request_releaser import RequestReleaser
from kvserve.core.sched.request_table import RequestTable
from kvserve.core.sched.scheduler_checks import check_scheduler_integrity, make_scheduler_stats
from kvserve.core.sched.spec_decode_tracker import SpecDecodeTracker
from kvserve.core.sched.step_plan import StepPlan, empty_step_output
from kvserve.core.sched.step_results import StepResults
from kvserve.core.sched.utils import too_long_message
from kvserve.protocol.engine_core import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from kvserve.protocol.kv_events import KVCacheEvent
from kvserve.protocol.scheduler_output import GrammarOutput, SchedulerOutput
from kvserve.utils.census import CountsRequestState, census_of

if TYPE_CHECKING:
    from kvserve.config import EngineConfig, LoRAConfig, SchedulerConfig, SpeculativeConfig
    from kvserve.distributed.kv_transfer.kv_connector.base import KVConnectorBase_V1
    from kvserve.protocol.kv_cache_interface import KVCacheConfig
    from kvserve.protocol.runner_output import ModelRunnerOutput
    from kvserve.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

# What schedule() does with the request it was looking at.
_NEXT, _STOP = 0, 1


class Scheduler(SchedulerInterface):
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        *,
        log_stats: bool = True,
        lora_config: LoRAConfig | None = None,
        speculative_config: SpeculativeConfig | None = None,
        structured_output_manager: StructuredOutputManager | None = None,
        max_concurrent_batches: int = 1,
        pipeline_parallel_size: int = 1,
        kv_transfer: NoKVTransfer | None = None,
        encoder: NoEncoderPlanner | None = None,
    ) -> None:
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        self.log_stats = log_stats
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.enable_caching = kv_cache_manager.enable_caching
        # Adapters the workers hold at once: running requests use at most this many.
        self.max_loras = lora_config.max_loras if lora_config else None
        # Only the last pipeline stage samples: the others get the new tokens in the next
        # step's CachedRequestData.new_token_ids.
        self.send_new_token_ids = pipeline_parallel_size > 1
        self.table = RequestTable(SchedulingPolicy(scheduler_config.policy))
        self.kv_transfer = kv_transfer or NoKVTransfer()
        self.encoder = encoder or NoEncoderPlanner()
        self.grammars = GrammarTracker(structured_output_manager)
        self.spec_decode = SpecDecodeTracker(speculative_config, self.max_model_len)
        self.batches = InFlightBatches(
            max_concurrent_batches,
            self.max_num_running_reqs,
            scheduler_config.async_scheduling,
            self.max_model_len,
        )
        self.isolator = FailureIsolator()
        self.releaser = RequestReleaser(
            self.table,
            kv_cache_manager,
            self.kv_transfer,
            self.encoder,
            self.isolator,
            self.batches,
        )
        self.results = StepResults(
            self.table,
            self.releaser,
            kv_cache_manager,
            self.kv_transfer,
            self.encoder,
            self.grammars,
            self.spec_decode,
            self.batches,
            self.isolator,
            self.max_model_len,
        )

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        kv_cache_config: KVCacheConfig,
        log_stats: bool = True,
        enable_kv_cache_events: bool = False,
        structured_output_manager: StructuredOutputManager | None = None,
        max_concurrent_batches: int = 1,
    ) -> Scheduler:
        sched = config.scheduler_config
        kv_cache_manager = KVCacheManager(
            kv_cache_config,
            sched.max_model_len,
            enable_caching=config.cache_config.enable_prefix_caching,
            log_stats=log_stats,
            enable_kv_cache_events=enable_kv_cache_events,
            max_num_batched_tokens=sched.max_num_batched_tokens,
        )
        return cls(
            sched,
            kv_cache_manager,
            log_stats=log_stats,
            lora_config=config.lora_config,
            speculative_config=config.speculative_config,
            structured_output_manager=structured_output_manager,
            max_concurrent_batches=max_concurrent_batches,
            pipeline_parallel_size=config.parallel_config.pipeline_parallel_size,
            kv_transfer=KVTransferPlanner.create(config, kv_cache_config, kv_cache_manager),
            encoder=EncoderPlanner.create(config),
        )

    # ---- what callers read -----------------------------------------------------------------

    @property
    def requests(self) -> dict[str, Request]:
        return self.table.requests

    @property
    def running(self) -> list[Request]:
        return self.table.running

    @property
    def waiting(self) -> Iterable[Request]:
        return self.table.waiting

    @property
    def num_preemptions(self) -> int:
        return self.table.num_preemptions

    @property
    def connector(self) -> KVConnectorBase_V1 | None:
        return self.kv_transfer.connector

    @property
    def is_isolating(self) -> bool:
        return self.isolator.is_isolating

    @property
    def consecutive_unattributed_failures(self) -> int:
        return self.isolator.consecutive_unattributed_failures

    # ---- requests in and out ---------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if (
            self.enable_caching
            and len(request.block_hashes) < request.num_tokens // self.block_size
        ):
            raise ValueError(
                f"request {request.request_id} has no block hashes: create it with "
                "block_hasher=get_request_block_hasher(block_size, seed)"
            )
        self.encoder.check_request(request)
        self.table.add(request)

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        assert RequestStatus.is_finished(finished_status)
        ids = (request_ids,) if isinstance(request_ids, str) else request_ids
        finished = [r for rid in ids if (r := self.table.get(rid)) and not r.is_finished()]
        for request in finished:
            request.status = finished_status
            self.releaser.free(request)
        self.table.remove(finished)

    # ---- schedule --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        flush = self.isolator.take_flush()
        if flush is not None:
            return self._empty_output(flush)
        probe = self.isolator.probe()
        table = self.table
        plan = StepPlan(
            self.max_num_scheduled_tokens,
            self.encoder.max_num_encoder_input_tokens,
            self.batches.request_cap(len(table)),
        )
        # RUNNING first: a waiting request never takes budget or blocks from a running one.
        index = 0
        while index < len(table.running) and plan.has_room():
            request = table.running[index]
            if self.batches.blocks(request) or (
                probe is not None and request.request_id not in probe
            ):
                index += 1
                continue
            num_preempted = len(plan.preempted)
            try:
                if self._schedule_running(request, plan) == _STOP:
                    break  # the request preempted itself; nothing after it can fit either
            except Exception as error:
                self._fail_in_schedule(request, plan, error)
                continue  # it left running: the next one is at the same index
            if len(plan.preempted) == num_preempted:
                index += 1
            else:  # victims taken from before it shift it
                index = table.running.index(request) + 1
        # WAITING next, unless this step already had to preempt (blocks are short).
        skipped = create_request_queue(table.policy)
        while not plan.preempted and table.waiting and plan.has_room():
            if len(table.running) >= self.max_num_running_reqs:
                break
            request = table.waiting.pop_request()
            if self.batches.blocks(request) or (
                probe is not None and request.request_id not in probe
            ):
                skipped.add_request(request)
                continue
            try:
                outcome = self._schedule_waiting(request, plan, skipped)
            except Exception as error:
                self._fail_in_schedule(request, plan, error)
                continue
            if outcome == _STOP:
                table.waiting.prepend_request(request)
                break
        if skipped:
            table.waiting.prepend_requests(skipped)
        if probe is not None and not plan.num_scheduled_tokens:
            self.isolator.abandon()
        return self._finish_plan(plan)

    def _schedule_running(self, request: Request, plan: StepPlan) -> int:
        # Async scheduling: the tokens of steps in flight are computed before they are known.
        ahead = request.num_tokens_with_spec + request.num_output_placeholders
        num_new_tokens = self._cap_new_tokens(
            ahead - request.num_computed_tokens, plan.token_budget
        )
        encoder_inputs, num_new_tokens, encoder_budget = self.encoder.try_schedule(
            request, request.num_computed_tokens, num_new_tokens, plan.encoder_budget
        )
        if num_new_tokens <= 0:
            return _NEXT
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new_tokens, num_lookahead_tokens=self.spec_decode.num_lookahead_tokens
            )
            if new_blocks is not None:
                break
            victim = self.table.pop_victim()
            plan.undo(victim)  # already scheduled in this step: its budget comes back
            self.releaser.preempt(victim)
            plan.preempted.append(victim)
            if victim is request:
                return _STOP
        plan.running.append(request)
        plan.grant(
            request,
            num_new_tokens,
            new_blocks,
            self.spec_decode.scheduled_drafts(request, num_new_tokens),
            self.encoder.allocate(request, encoder_inputs) if encoder_inputs else [],
            encoder_budget,
        )
        return _NEXT

    def _schedule_waiting(self, request: Request, plan: StepPlan, skipped: RequestQueue) -> int:
        """Admits a request popped from waiting, parks it in ``skipped``, or (_STOP) hands
        it back for the caller to put first in line again."""
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            skipped.add_request(request)  # its async KV load still runs
            return _NEXT
        if request.status == RequestStatus.WAITING_FOR_FSM:
            ready, error = self.grammars.grammar_ready(request)
            if error is not None:
                self.releaser.fail(request, error)
            elif not ready:
                skipped.add_request(request)  # its grammar still compiles
            if not ready:
                return _NEXT
        if self.table.lora_slots_full(request, self.max_loras):
            skipped.add_request(request)  # its adapter would be one too many in a step
            return _NEXT
        if request.num_prompt_tokens > self.max_model_len or not (
            self.kv_cache_manager.fits_in_pool(request.num_tokens)
        ):
            self.releaser.fail(
                request,
                too_long_message(
                    request,
                    self.max_model_len,
                    self.kv_cache_manager.block_pool.num_blocks - 1,
                    self.block_size,
                ),
            )
            return _NEXT
        manager = self.kv_cache_manager
        if self.kv_transfer.is_load_done(request.request_id):
            new_computed_blocks, num_new_local = manager.empty_kv_cache_blocks, 0
        else:
            new_computed_blocks, num_new_local = manager.get_computed_blocks(request)
        num_computed_tokens = request.num_computed_tokens + num_new_local
        # External hits (a KV connector) come after the local ones.
        num_external, load_async = self.kv_transfer.match_external(request, num_computed_tokens)
        if num_external is None:  # the connector decides next step
            skipped.add_request(request)
            return _NEXT
        num_new_tokens = request.num_tokens - num_computed_tokens - num_external
        if load_async:
            num_new_tokens = 0  # only slots for the loaded KV; compute after it arrived
        elif not self.enable_chunked_prefill and num_new_tokens > plan.token_budget:
            # Without chunking a prompt runs whole; let smaller ones behind it go.
            skipped.prepend_request(request)
            return _NEXT
        num_new_tokens = self._cap_new_tokens(num_new_tokens, plan.token_budget)
        encoder_inputs: list[int] = []
        encoder_budget = plan.encoder_budget
        if not load_async:
            encoder_inputs, num_new_tokens, encoder_budget = self.encoder.try_schedule(
                request, num_computed_tokens + num_external, num_new_tokens, encoder_budget
            )
            if num_new_tokens <= 0:
                return _STOP  # its next image needs a step with more budget
        new_blocks = manager.allocate_slots(
            request,
            num_new_tokens,
            num_new_local,
            new_computed_blocks,
            num_lookahead_tokens=self.spec_decode.num_lookahead_tokens,
            # Loaded blocks are cached once the load is known good (update_from_output).
            delay_cache_blocks=num_external > 0,
            num_external_computed_tokens=num_external,
        )
        if new_blocks is None:
            return _STOP  # waits for blocks; waiting requests never preempt
        self.kv_transfer.after_alloc(request, num_external, load_async, num_computed_tokens)
        if load_async:
            skipped.add_request(request)  # WAITING_FOR_REMOTE_KVS until loaded
            return _NEXT
        num_computed_tokens += num_external
        resumed = self.table.start_running(request)
        (plan.resumed if resumed else plan.new).append(request)
        request.num_computed_tokens = num_computed_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed_tokens
        plan.grant(
            request,
            num_new_tokens,
            # New and resumed requests send their whole block table.
            manager.get_blocks(request.request_id),
            [],
            self.encoder.allocate(request, encoder_inputs) if encoder_inputs else [],
            encoder_budget,
        )
        return _NEXT

    def _fail_in_schedule(self, request: Request, plan: StepPlan, error: Exception) -> None:
        """Scheduling ``request`` raised: it alone ends with the error. Whatever it was
        granted in this step is handed back and its blocks are freed with it."""
        logger.exception("scheduling request %s failed: it ends with an error", request.request_id)
        plan.undo(request)
        self.releaser.fail(request, f"{type(error).__name__}: {error}")

    def _finish_plan(self, plan: StepPlan) -> SchedulerOutput:
        assert plan.total_num_scheduled_tokens <= self.max_num_scheduled_tokens
        running = self.table.running
        assert len(running) <= self.max_num_running_reqs
        scheduler_output = plan.to_output(
            self.table.take_finished_req_ids(),
            self.kv_cache_manager.get_num_common_prefix_blocks(running[0].request_id)
            if running
            else (),
            self.encoder.take_freed_hashes(),
            self.send_new_token_ids,
        )
        scheduler_output.kv_connector_metadata = self.kv_transfer.build_meta(scheduler_output)
        # The tokens count as computed once scheduled; update_from_output adds samples.
        for request_id, n in plan.num_scheduled_tokens.items():
            self.table.requests[request_id].num_computed_tokens += n
        self.batches.mark(scheduler_output, self.table.requests)
        return scheduler_output

    def _empty_output(self, preempted_req_ids: set[str]) -> SchedulerOutput:
        """A step without tokens that drops a failed step's requests from the workers."""
        output = empty_step_output(self.table.take_finished_req_ids(), preempted_req_ids)
        output.kv_connector_metadata = self.kv_transfer.build_meta(output)
        return output

    def _cap_new_tokens(self, num_new_tokens: int, token_budget: int) -> int:
        if 0 < self.long_prefill_token_threshold < num_new_tokens:
            num_new_tokens = self.long_prefill_token_threshold
        return min(num_new_tokens, token_budget)

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The bitmask rows of the constrained requests that sample in this step (call it
        after schedule(), before the step's tokens are sampled); None when there are none."""
        return self.grammars.bitmask(scheduler_output, self.table.requests)

    # ---- outputs ---------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        outputs = self.results.update_from_output(scheduler_output, model_runner_output)
        return EngineCoreOutputs(
            outputs=outputs,
            scheduler_stats=self.make_stats(),
            timestamp=time.monotonic(),
            scheduled_times=self.table.take_scheduled_times(),
        )

    def isolate_failed_step(
        self, scheduler_output: SchedulerOutput, message: str
    ) -> list[EngineCoreOutput]:
        """Blames a lone request, or turns the step's requests into suspects (see
        failure_isolator.py); returns the outputs of requests this ended (the culprit's,
        carrying ``message``)."""
        return self.results.isolate_failed_step(scheduler_output, message)

    def discard_step(self, scheduler_output: SchedulerOutput) -> None:
        """A step sent on a failed step's placeholders (async scheduling) is void."""
        self.results.discard_step(scheduler_output)

    # ---- state and stats -------------------------------------------------------------------

    def get_num_unfinished_requests(self) -> int:
        return len(self.table)

    def has_finished_requests(self) -> bool:
        return bool(
            self.table.finished_req_ids
            or self.table.pending_outputs
            or self.kv_transfer.has_delayed_frees()
        )

    def make_stats(self) -> SchedulerStats | None:
        return make_scheduler_stats(self) if self.log_stats else None

    def request_census(self) -> dict[str, int]:
        """Live per-request entries of every collaborator (see utils/census.py)."""
        owners: dict[str, CountsRequestState] = {
            "table": self.table,
            "kv_cache": self.kv_cache_manager,
            "kv_transfer": self.kv_transfer,
            "encoder": self.encoder,
            "batches": self.batches,
            "isolator": self.isolator,
        }
        return census_of(owners)

    def check_integrity(self) -> None:
        """Raises AssertionError if the queues, requests and KV cache disagree (tests,
        debug); call it between steps (scheduler_checks.py)."""
        check_scheduler_integrity(self)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def take_kv_events(self) -> list[KVCacheEvent]:
        return self.kv_cache_manager.take_events()

    def shutdown(self) -> None:
        self.kv_transfer.shutdown()
