"""vLLM v1's scheduler: one token budget shared by prefills and decodes.

Every request has num_computed_tokens catching up to num_tokens. Each step first
serves the RUNNING requests (decodes and unfinished prefill chunks), preempting by
recompute when the KV cache runs out, then admits WAITING ones (after prefix-cache
hits) while budget, max_num_seqs and free blocks last.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvserve.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.sched.batch_queue_mixin import SchedulerBatchQueueMixin
from kvserve.core.sched.encoder_mixin import SchedulerEncoderMixin
from kvserve.core.sched.finishing import SchedulerFinishingMixin
from kvserve.core.sched.interface import SchedulerInterface
from kvserve.core.sched.isolation import SchedulerIsolationMixin
from kvserve.core.sched.kv_connector_mixin import SchedulerKVConnectorMixin
from kvserve.core.sched.request_queue import SchedulingPolicy, create_request_queue
from kvserve.core.sched.spec_decode_mixin import SchedulerSpecDecodeMixin
from kvserve.core.sched.stats_mixin import SchedulerStatsMixin
from kvserve.core.sched.structured_output_mixin import SchedulerStructuredOutputMixin
from kvserve.core.sched.utils import (
    check_stop,
    make_cached_request_data,
    make_engine_core_output,
)
from kvserve.distributed.kv_events import KVCacheEvent
from kvserve.protocol.engine_core import EngineCoreOutput, EngineCoreOutputs
from kvserve.protocol.scheduler_output import NewRequestData, SchedulerOutput

if TYPE_CHECKING:
    from kvserve.config import EngineConfig
    from kvserve.protocol.kv_cache_interface import KVCacheConfig
    from kvserve.protocol.runner_output import ModelRunnerOutput
    from kvserve.structured_output.manager import StructuredOutputManager


class Scheduler(
    SchedulerBatchQueueMixin,
    SchedulerIsolationMixin,
    SchedulerKVConnectorMixin,
    SchedulerStructuredOutputMixin,
    SchedulerSpecDecodeMixin,
    SchedulerEncoderMixin,
    SchedulerFinishingMixin,
    SchedulerStatsMixin,
    SchedulerInterface,
):
    def __init__(
        self,
        config: EngineConfig,
        kv_cache_config: KVCacheConfig,
        log_stats: bool = True,
        enable_kv_cache_events: bool = False,
        structured_output_manager: StructuredOutputManager | None = None,
        max_concurrent_batches: int = 1,
    ) -> None:
        sched = config.scheduler_config
        self.max_num_running_reqs = sched.max_num_seqs
        self.max_num_scheduled_tokens = sched.max_num_batched_tokens
        self.max_model_len = sched.max_model_len
        self.enable_chunked_prefill = sched.enable_chunked_prefill
        self.long_prefill_token_threshold = sched.long_prefill_token_threshold
        self.policy = SchedulingPolicy(sched.policy)
        self.log_stats = log_stats
        self.block_size = config.cache_config.block_size
        self.enable_caching = config.cache_config.enable_prefix_caching
        # Adapters the workers hold at once: running requests use at most this many.
        self.max_loras = config.lora_config.max_loras if config.lora_config else None
        self.kv_cache_manager = KVCacheManager(
            kv_cache_config,
            self.max_model_len,
            enable_caching=self.enable_caching,
            log_stats=log_stats,
            enable_kv_cache_events=enable_kv_cache_events,
            max_num_batched_tokens=self.max_num_scheduled_tokens,
        )
        # The KV connector's scheduler side (None without kv_transfer_config).
        self._init_kv_connector(config, kv_cache_config)
        self._init_structured_outputs(structured_output_manager)

        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Finished since the last schedule(): the workers drop their state for these.
        self.finished_req_ids: set[str] = set()
        # Requests the scheduler itself ended (cannot fit): reported by the next update.
        self._pending_outputs: list[EngineCoreOutput] = []
        self.num_preemptions = 0
        # Suspects of a failed step, run a probe at a time (isolation.py).
        self._init_isolation()
        # Drafts per request and their acceptance totals (spec_decode_mixin.py).
        self._init_spec_decode(config)
        # Encoder budget and cache of multimodal models (encoder_mixin.py).
        self._init_encoder(config)
        # Micro-batches in flight at once (the engine's batch queue; batch_queue_mixin.py).
        self._init_batch_queue(
            max_concurrent_batches, config.parallel_config.pipeline_parallel_size
        )

    # --- requests in and out ------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if (
            self.enable_caching
            and len(request.block_hashes) < request.num_tokens // self.block_size
        ):
            raise ValueError(
                f"request {request.request_id} has no block hashes: create it with "
                "block_hasher=get_request_block_hasher(block_size, seed)"
            )
        self.check_mm_request(request)
        self.requests[request.request_id] = request
        self.waiting.add_request(request)

    # --- schedule -----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        # While a failed step's suspects remain, only the probe among them runs.
        probe: set[str] | None = None
        if self._suspects:
            flush = self._take_flush()
            if flush is not None:
                return flush
            probe = self._current_probe()
        token_budget = self.max_num_scheduled_tokens
        num_scheduled_tokens: dict[str, int] = {}
        req_to_new_blocks: dict[str, KVCacheBlocks] = {}
        scheduled_running: list[Request] = []
        scheduled_new: list[Request] = []
        scheduled_resumed: list[Request] = []
        preempted: list[Request] = []
        scheduled_spec_decode_tokens: dict[str, list[int]] = {}
        encoder_budget = self.max_num_encoder_input_tokens
        scheduled_encoder_inputs: dict[str, list[int]] = {}
        max_reqs = self._batch_request_cap()

        # RUNNING first: a waiting request never takes budget or blocks from a running one.
        req_index = 0
        while (
            req_index < len(self.running)
            and token_budget > 0
            and len(num_scheduled_tokens) < max_reqs
        ):
            request = self.running[req_index]
            if self._is_in_flight(request) or (
                probe is not None and request.request_id not in probe
            ):
                req_index += 1
                continue
            num_new_tokens = self._cap_new_tokens(
                request.num_tokens_with_spec - request.num_computed_tokens, token_budget
            )
            encoder_inputs, num_new_tokens, new_encoder_budget = self._try_schedule_encoder_inputs(
                request, request.num_computed_tokens, num_new_tokens, encoder_budget
            )
            if num_new_tokens <= 0:
                req_index += 1
                continue
            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request, num_new_tokens, num_lookahead_tokens=self.num_lookahead_tokens
                )
                if new_blocks is not None:
                    break
                victim = self._pick_victim()
                if victim.request_id in num_scheduled_tokens:
                    # Already scheduled in this step: hand its budget back.
                    scheduled_running.remove(victim)
                    token_budget += num_scheduled_tokens.pop(victim.request_id)
                    req_to_new_blocks.pop(victim.request_id)
                    scheduled_spec_decode_tokens.pop(victim.request_id, None)
                    scheduled_encoder_inputs.pop(victim.request_id, None)
                    req_index -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                break  # the request preempted itself; nothing after it can fit either
            scheduled_running.append(request)
            req_to_new_blocks[request.request_id] = new_blocks
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            if encoder_inputs:
                scheduled_encoder_inputs[request.request_id] = self._allocate_encoder_inputs(
                    request, encoder_inputs
                )
                encoder_budget = new_encoder_budget
            spec_tokens = self._scheduled_spec_tokens(request, num_new_tokens)
            if spec_tokens:
                scheduled_spec_decode_tokens[request.request_id] = spec_tokens
            req_index += 1

        # WAITING next, unless this step already had to preempt (blocks are short).
        skipped = create_request_queue(self.policy)
        while not preempted and self.waiting and token_budget > 0:
            if len(self.running) >= self.max_num_running_reqs:
                break
            if len(num_scheduled_tokens) >= max_reqs:
                break
            request = self.waiting.peek_request()
            if self._is_in_flight(request) or (
                probe is not None and request.request_id not in probe
            ):
                skipped.add_request(self.waiting.pop_request())
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                # Its async KV load is still running (update_from_output releases it).
                skipped.add_request(self.waiting.pop_request())
                continue
            if request.status == RequestStatus.WAITING_FOR_FSM and not self._grammar_ready(request):
                # Its grammar still compiles (or failed: then it is finished already).
                self.waiting.pop_request()
                if not request.is_finished():
                    skipped.add_request(request)
                continue
            if self._lora_slots_full(request):
                # Its adapter would be one too many in a step: it waits for a slot.
                skipped.add_request(self.waiting.pop_request())
                continue
            if request.num_prompt_tokens > self.max_model_len or not (
                self.kv_cache_manager.fits_in_pool(request.num_tokens)
            ):
                self.waiting.pop_request()
                self._finish_with_error(request, self._too_long_message(request))
                continue
            if request.request_id in self._async_load_done:
                # Its async KV load finished: it holds its blocks, no lookup again.
                new_computed_blocks = self.kv_cache_manager.empty_kv_cache_blocks
                num_new_local = 0
            else:
                new_computed_blocks, num_new_local = self.kv_cache_manager.get_computed_blocks(
                    request
                )
            num_computed_tokens = request.num_computed_tokens + num_new_local
            # External hits (a KV connector) come after the local ones.
            num_external, load_async = self._match_external(request, num_computed_tokens)
            if num_external is None:  # the connector decides next step
                skipped.add_request(self.waiting.pop_request())
                continue
            num_new_tokens = request.num_tokens - num_computed_tokens - num_external
            if load_async:
                num_new_tokens = 0  # only slots for the loaded KV; compute after it arrived
            elif not self.enable_chunked_prefill and num_new_tokens > token_budget:
                # Without chunking a prompt runs whole; let smaller ones behind it go.
                skipped.prepend_request(self.waiting.pop_request())
                continue
            num_new_tokens = self._cap_new_tokens(num_new_tokens, token_budget)
            encoder_inputs, new_encoder_budget = [], encoder_budget
            if not load_async:
                encoder_inputs, num_new_tokens, new_encoder_budget = (
                    self._try_schedule_encoder_inputs(
                        request, num_computed_tokens + num_external, num_new_tokens, encoder_budget
                    )
                )
                if num_new_tokens <= 0:
                    break  # its next image needs a step with more budget
            new_blocks = self.kv_cache_manager.allocate_slots(
                request,
                num_new_tokens,
                num_new_local,
                new_computed_blocks,
                # Loaded blocks are cached once the load is known good (update_from_output).
                num_lookahead_tokens=self.num_lookahead_tokens,
                delay_cache_blocks=num_external > 0,
                num_external_computed_tokens=num_external,
            )
            if new_blocks is None:
                break  # waits for blocks; waiting requests never preempt
            self.waiting.pop_request()
            self._async_load_done.discard(request.request_id)
            self._after_alloc(request, num_external, load_async, num_computed_tokens)
            if load_async:
                skipped.add_request(request)  # WAITING_FOR_REMOTE_KVS until loaded
                continue
            num_computed_tokens += num_external
            self.running.append(request)
            if request.status == RequestStatus.PREEMPTED:
                scheduled_resumed.append(request)
            else:
                scheduled_new.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
            # New and resumed requests send their whole block table.
            req_to_new_blocks[request.request_id] = self.kv_cache_manager.get_blocks(
                request.request_id
            )
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            if encoder_inputs:
                scheduled_encoder_inputs[request.request_id] = self._allocate_encoder_inputs(
                    request, encoder_inputs
                )
                encoder_budget = new_encoder_budget
        if skipped:
            self.waiting.prepend_requests(skipped)
        if probe is not None and not num_scheduled_tokens:
            self._abandon_isolation()

        total = sum(num_scheduled_tokens.values())
        assert total <= self.max_num_scheduled_tokens
        assert len(self.running) <= self.max_num_running_reqs
        num_common_prefix_blocks: tuple[int, ...] = ()
        if self.running:
            num_common_prefix_blocks = self.kv_cache_manager.get_num_common_prefix_blocks(
                self.running[0].request_id
            )
        new_reqs_data = [
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                sampling_params=r.sampling_params,
                block_ids=req_to_new_blocks[r.request_id].get_block_ids(),
                num_computed_tokens=r.num_computed_tokens,
                output_token_ids=list(r.output_token_ids),
                pooling_params=r.pooling_params,
                lora_request=r.lora_request,
                mm_features=r.mm_features,
            )
            for r in scheduled_new
        ]
        cached_reqs_data = make_cached_request_data(
            scheduled_running,
            scheduled_resumed,
            req_to_new_blocks,
            num_scheduled_tokens if self.send_new_token_ids else None,
        )
        scheduler_output = SchedulerOutput(
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached_reqs_data,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total,
            num_common_prefix_blocks=num_common_prefix_blocks,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted},
            scheduled_spec_decode_tokens=scheduled_spec_decode_tokens,
            scheduled_encoder_inputs=scheduled_encoder_inputs,
            free_encoder_mm_hashes=self._take_freed_encoder_hashes(),
        )
        if self.connector is not None:
            # Before num_computed_tokens advances: the connector plans from the step's start.
            scheduler_output.kv_connector_metadata = self.connector.build_connector_meta(
                scheduler_output
            )
        self.finished_req_ids = set()
        # The tokens count as computed once scheduled; update_from_output adds samples.
        for request_id, n in num_scheduled_tokens.items():
            self.requests[request_id].num_computed_tokens += n
        self._mark_in_flight(scheduler_output)
        return scheduler_output

    def _cap_new_tokens(self, num_new_tokens: int, token_budget: int) -> int:
        if 0 < self.long_prefill_token_threshold < num_new_tokens:
            num_new_tokens = self.long_prefill_token_threshold
        return min(num_new_tokens, token_budget)

    def _pick_victim(self) -> Request:
        """The running request to preempt: lowest priority (latest arrival) or the last."""
        if self.policy == SchedulingPolicy.PRIORITY:
            victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
            self.running.remove(victim)
            return victim
        return self.running.pop()

    def _preempt(self, request: Request) -> None:
        # Recompute: drop the KV (its full blocks stay cached), start over from the waiting queue.
        self.kv_cache_manager.free(request)
        self._free_encoder(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)

    def _too_long_message(self, request: Request) -> str:
        if request.num_prompt_tokens > self.max_model_len:
            return (
                f"the prompt ({request.num_prompt_tokens} tokens) is longer than "
                f"max_model_len ({self.max_model_len})"
            )
        pool = self.kv_cache_manager.block_pool.num_blocks - 1
        return (
            f"the request needs {request.num_tokens} tokens of KV cache, more than the "
            f"{pool} blocks of {self.block_size} tokens the pool holds"
        )

    # --- outputs ------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        self._release_in_flight(scheduler_output)
        # KV connector results first: a failed load voids (or, policy "fail", ends) a request.
        kv_output = model_runner_output.kv_connector_output
        dropped = self._handle_invalid_blocks(
            scheduler_output, kv_output.invalid_block_ids if kv_output else set()
        )
        self._update_from_kv_xfer_finished(kv_output)
        self._cache_sync_loaded()
        self._record_encoder_output(model_runner_output)
        outputs: list[EngineCoreOutput] = []
        stopped: set[str] = set()
        probe = self._probe if self._suspects else None
        passed: list[str] = []
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is None or request.is_finished() or request_id in dropped:
                continue  # aborted while the step ran, or recomputes after a failed KV load
            req_index = model_runner_output.req_id_to_index.get(request_id)
            scheduled_spec = scheduler_output.scheduled_spec_decode_tokens.get(request_id)
            if scheduled_spec is not None:
                num_generated = (
                    0
                    if req_index is None
                    else len(model_runner_output.sampled_token_ids[req_index])
                )
                self._apply_spec_result(request, scheduled_spec, num_generated)
            new_token_ids: list[int] = []
            # A partial prefill samples nothing useful: only a caught-up request takes tokens.
            if req_index is not None and request.num_computed_tokens >= request.num_tokens:
                new_token_ids = list(model_runner_output.sampled_token_ids[req_index])
                if probe is not None and request_id in probe:
                    passed.append(request_id)
            is_stopped = False
            self._free_computed_encoder_inputs(request)
            pooled = model_runner_output.pooler_output.get(request_id)
            if pooled is not None:  # a pooling request is done once its prompt is
                new_token_ids = []  # and samples nothing
                request.status = RequestStatus.FINISHED_STOPPED
                is_stopped = True
            for i, token_id in enumerate(new_token_ids):
                request.append_output_token_ids(token_id)
                if check_stop(request, self.max_model_len) or self._advance_grammar(
                    request, token_id
                ):
                    del new_token_ids[i + 1 :]
                    is_stopped = True
                    break
            output = make_engine_core_output(request, new_token_ids, model_runner_output, req_index)
            if output is not None:
                output.pooling_output = pooled
                outputs.append(output)
            spec_token_ids = model_runner_output.spec_token_ids
            if not is_stopped and spec_token_ids is not None and req_index is not None:
                self._update_draft_token_ids(request, spec_token_ids[req_index])
            if is_stopped:
                stopped.add(request_id)
                kv_transfer_params = self._free_request(request)
                if output is not None:
                    output.kv_transfer_params = kv_transfer_params
        if stopped:
            self.running = [r for r in self.running if r.request_id not in stopped]
        if probe is not None:
            self._clear_suspects(passed)
        elif scheduler_output.total_num_scheduled_tokens:
            self.consecutive_unattributed_failures = 0
        # Taken last: should this method raise halfway, isolate_failed_step reports them.
        outputs[:0], self._pending_outputs = self._pending_outputs, []
        # Hook: KV event publishing goes here.
        return EngineCoreOutputs(
            outputs=outputs, scheduler_stats=self.make_stats(), timestamp=time.monotonic()
        )

    def _lora_slots_full(self, request: Request) -> bool:
        lora = request.lora_request
        if lora is None or self.max_loras is None:
            return False
        active = {r.lora_request.lora_int_id for r in self.running if r.lora_request}
        return lora.lora_int_id not in active and len(active) >= self.max_loras

    # --- state and stats ----------------------------------------------------------

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_finished_requests(self) -> bool:
        # Blocks held for a KV connector's sends keep the engine stepping until released.
        return bool(self.finished_req_ids or self._pending_outputs or self._delayed_free)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def take_kv_events(self) -> list[KVCacheEvent]:
        return self.kv_cache_manager.take_events()

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()
