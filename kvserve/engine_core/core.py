"""EngineCore: the inner loop — schedule, execute, update — around one executor."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from typing import cast

import msgspec
import torch

from kvserve.config import EngineConfig, GiB
from kvserve.core.kv_cache_utils import get_request_block_hasher
from kvserve.core.request import Request, RequestStatus
from kvserve.core.sched.scheduler import Scheduler
from kvserve.distributed.kv_events_publisher import EventPublisherFactory, InBandEventPublisher
from kvserve.engine_core.batch_queue import BatchQueue, InFlightBatch, tells_workers
from kvserve.executor.abstract import Executor, ExecutorFailedError
from kvserve.protocol.engine_core import (
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
    StepTimes,
)
from kvserve.protocol.kv_cache_interface import (
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    build_kv_cache_config,
    group_capacity_per_gib,
    kv_bytes_per_token,
    max_concurrent_requests,
    max_tokens_per_request,
)
from kvserve.protocol.kv_events import KVEvent, KVEventBatch
from kvserve.protocol.runner_output import ModelRunnerOutput
from kvserve.protocol.scheduler_output import SchedulerOutput
from kvserve.protocol.sleep_mode import SLEEP_TAGS, check_sleep_level, check_wake_tags
from kvserve.structured_output.manager import StructuredOutputManager
from kvserve.transformers_utils.tokenizer import get_tokenizer
from kvserve.utils.census import per_request_objects, prefixed
from kvserve.utils.startup import log_phase, startup_phase
from kvserve.utils.threads import usable_cores

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        executor_class: type[Executor] | None = None,
        log_stats: bool = True,
    ) -> None:
        self.config = config
        data_parallel_size = config.parallel_config.data_parallel_size
        if data_parallel_size > 1:
            # Each data-parallel core gets its share of the cores (its -tp workers split
            # that share again); all of them each would have the ranks fight over them.
            torch.set_num_threads(max(1, usable_cores() // data_parallel_size))
        log_thread_settings("engine core")
        executor_class = executor_class or Executor.get_class(config)
        if config.kv_transfer_config is not None and config.parallel_config.world_size > 1:
            from kvserve.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

            # Before any worker starts: a connector that cannot serve the ranks says so.
            KVConnectorFactory.check_parallel_config(config)
        with startup_phase("model load", executor=executor_class.__name__):
            self.model_executor = executor_class(config)
        self.kv_cache_config = self._initialize_kv_caches()
        events_config = config.kv_events_config
        enable_kv_cache_events = bool(events_config and events_config.enable_kv_cache_events)
        parallel = config.parallel_config
        # Data parallelism with prefix balancing: the front end's prefix index follows
        # this core's events, which ride on its outputs (core_proc.py).
        self.in_band_kv_events = InBandEventPublisher(
            parallel.front_end_balances
            and parallel.data_parallel_load_balance == "prefix"
            and config.cache_config.enable_prefix_caching
        )
        enable_kv_cache_events |= self.in_band_kv_events.enabled
        if enable_kv_cache_events and not config.cache_config.enable_prefix_caching:
            logger.warning("KV cache events are enabled but prefix caching is off: none will come")
        # Grammars compile on its threads; the tokenizer loads there on first use.
        self.structured_output_manager = StructuredOutputManager(
            config.structured_outputs_config.backend,
            config.model_config.vocab_size,
            config.scheduler_config.max_num_seqs,
            load_tokenizer=lambda: get_tokenizer(config.model_config.tokenizer_resolved),
        )
        self.scheduler = Scheduler.from_config(
            config,
            self.kv_cache_config,
            log_stats=log_stats,
            enable_kv_cache_events=enable_kv_cache_events,
            structured_output_manager=self.structured_output_manager,
            max_concurrent_batches=self.model_executor.max_concurrent_batches,
        )
        if self.scheduler.connector is not None:
            self._exchange_connector_handshakes()
        # Steps in flight at once: 1, or one micro-batch per pipeline stage (batch_queue.py).
        self.batch_queue = BatchQueue(self.model_executor.max_concurrent_batches)
        # Each data-parallel rank publishes on its own ports (the configured ones + rank).
        self.kv_event_publisher = EventPublisherFactory.create(
            events_config,
            data_parallel_rank=parallel.data_parallel_rank,
            kv_secret_file=config.kv_security_config.kv_secret_file,
        )
        cache = config.cache_config
        self.block_hasher = (
            get_request_block_hasher(cache.block_size, cache.prefix_caching_hash_seed)
            if cache.enable_prefix_caching
            else None
        )
        # Running totals per step phase; kept, like the other stats, only when logged.
        self.step_times: StepTimes | None = StepTimes() if log_stats else None
        # Sleep mode: the tags (protocol/sleep_mode.py) whose memory the workers gave back.
        self.asleep_tags: set[str] = set()

    def settle_heap(self) -> None:
        """Freezes what is alive now (modules, tokenizer tables, imported libraries),
        which lives as long as the engine: frozen, it is left out of the collector's full
        passes, which the objects every step allocates would otherwise trigger over and
        over (~3% of a long batched run). shutdown() hands it back. Called by the engine's
        owner once start-up is over; the collection first takes ~0.1 s, which a served
        core spends after its handshake rather than before."""
        gc.collect()
        gc.freeze()

    def _exchange_connector_handshakes(self) -> None:
        """Tells the scheduler-side connector how to reach each rank's worker side (e.g.
        a lookup service bound on a Ray node's address)."""
        assert self.scheduler.connector is not None
        replies = self.model_executor.collective_rpc("get_kv_connector_handshake_metadata")
        metadata = {rank: reply for rank, reply in enumerate(replies) if reply}
        if metadata:
            self.scheduler.connector.set_xfer_handshake_metadata(metadata)

    def _initialize_kv_caches(self) -> KVCacheConfig:
        start = time.perf_counter()
        specs: dict[str, KVCacheSpec] = {}
        for worker_specs in self.model_executor.get_kv_cache_specs():
            specs.update(worker_specs)  # pipeline stages each report their own layers
        cache = self.config.cache_config
        memory = cache.kv_cache_memory
        if cache.gpu_memory_utilization is not None:
            # CUDA: each worker's profile says what its share of the device leaves for the
            # KV cache; the tightest sizes the pool every worker allocates.
            memory = min(self.model_executor.determine_available_memory())
        kv_cache_config = build_kv_cache_config(specs, memory, cache.num_blocks_override)
        self.model_executor.initialize_from_config(kv_cache_config)
        max_batched = self.config.scheduler_config.max_num_batched_tokens
        capacity = max_tokens_per_request(kv_cache_config, max_batched)
        max_len = self.config.model_config.max_model_len or 0
        if capacity < max_len:
            logger.warning(
                "KV cache holds %d tokens, less than max_model_len=%d: longer "
                "requests will be rejected",
                capacity,
                max_len,
            )
        for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            logger.info(
                "KV cache group %d: %s, %d layers, a request holds at most %d blocks of %d tokens",
                group_id,
                spec.type_id,
                len(group.layer_names),
                spec.max_num_blocks(max(max_len, 1), max_batched),
                spec.block_size,
            )
        per_token = kv_bytes_per_token(kv_cache_config)
        logger.info(
            "KV cache: %.0f bytes per token across layers, %d tokens per GiB",
            per_token,
            int(GiB // per_token),
        )
        if any(g.kv_cache_spec.kind == MambaSpec.kind for g in kv_cache_config.kv_cache_groups):
            # A Mamba group's block is a request's state: its capacity is in requests.
            per_gib = group_capacity_per_gib(kv_cache_config)
            logger.info(
                "KV cache per GiB: %s; %d concurrent requests of max_model_len=%d tokens fit",
                ", ".join(
                    f"group {i} ({kind}) {n} {'requests' if kind == MambaSpec.kind else 'tokens'}"
                    for i, (kind, n) in enumerate(per_gib)
                ),
                max_concurrent_requests(kv_cache_config, max(max_len, 1), max_batched),
                max_len,
            )
        log_phase(
            "KV cache",
            time.perf_counter() - start,
            blocks=kv_cache_config.num_blocks,
            block_size=cache.block_size,
            groups=len(kv_cache_config.kv_cache_groups),
            tensors=len(kv_cache_config.get_kv_cache_tensors()),
            bytes_per_block=kv_cache_config.bytes_per_block,
            tokens=capacity,
        )
        return kv_cache_config

    def add_request(self, request: EngineCoreRequest) -> None:
        """Raises ValueError for a request the model cannot run (the caller fails it alone).

        The front end validated it already; this guards the core against clients that speak
        its wire protocol directly, since one out-of-vocabulary id fails the whole batch's
        forward pass.
        """
        if request.mm_features:
            request.mm_features = self.scheduler.encoder.receive_features(
                request.mm_features, self.config.model_config.arch.architecture
            )
        if self.asleep_tags:
            raise ValueError("the model is sleeping: wake it up (wake_up) before generating")
        vocab_size = self.config.model_config.vocab_size
        bad = [t for t in request.prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids contains token ids outside the vocabulary "
                f"[0, {vocab_size}): {bad[:5]}"
            )
        core_request = Request.from_engine_core_request(request, self.block_hasher)
        if core_request.structured_output_request is not None:
            self.structured_output_manager.grammar_init(core_request.structured_output_request)
        self.scheduler.add_request(core_request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    @property
    def max_batches_in_flight(self) -> int:
        return self.batch_queue.max_batches_in_flight

    def has_work(self) -> bool:
        """Whether a step has anything to do: requests, or batches still in flight."""
        return self.scheduler.has_requests() or bool(self.batch_queue)

    def step(self) -> tuple[EngineCoreOutputs, bool]:
        """One turn of the loop: sends a new step (a micro-batch) if the queue has room
        and the scheduler has one, and applies the oldest step's output when it is due.
        Returns the outputs (empty when none came back) and whether a step with tokens
        was sent."""
        queue = self.batch_queue
        start = time.perf_counter()
        sent = False
        if queue.has_room() and self.scheduler.has_requests():
            scheduler_output = self.scheduler.schedule()
            if self.step_times is not None:
                self.step_times.schedule += time.perf_counter() - start
            sent = scheduler_output.total_num_scheduled_tokens > 0
            if not sent and not queue:
                self.structured_output_manager.wait_for_compiles(timeout=0.01)
            if sent or not queue or tells_workers(scheduler_output):
                queue.send(scheduler_output, self.model_executor, self.scheduler)
        outputs = EngineCoreOutputs(timestamp=time.monotonic())
        if queue.oldest_due(sent):
            outputs = self._apply(queue.pop_oldest())
        if self.step_times is not None:
            self.step_times.busy += time.perf_counter() - start
            if outputs.scheduler_stats is not None:
                # A copy, taken once this step's busy time is in (its phases are): the
                # phases of a snapshot are always parts of its busy time. In-process
                # clients keep the message while the totals move on.
                outputs.scheduler_stats.step_times = msgspec.structs.replace(self.step_times)
        return outputs, sent

    def _apply(self, batch: InFlightBatch) -> EngineCoreOutputs:
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
            self._count_model_step(model_output)
        outputs.timestamp = time.monotonic()
        self._publish_kv_events()
        return outputs

    def _drain_finished(self) -> None:
        """Applies the batches still in flight once no request is left (async scheduling:
        the step sent on the placeholder of a request that then finished); what they
        sampled is for no one."""
        while self.batch_queue and not self.scheduler.get_num_unfinished_requests():
            self._apply(self.batch_queue.pop_oldest())

    def _count_model_step(self, model_output: ModelRunnerOutput) -> None:
        """Adds a model step to the step-time totals (step() snapshots them into its stats)."""
        times = self.step_times
        assert times is not None
        # The runner's own split of its part; the executor's glue counts as busy only.
        runner = model_output.step_times
        if runner is not None:
            times.prepare_inputs += runner.prepare_inputs
            times.forward += runner.forward
            times.sample += runner.sample
        times.num_steps += 1

    def _fail_step(self, scheduler_output: SchedulerOutput, error: Exception) -> EngineCoreOutputs:
        """Fails the request the step's failure is due to, alone; the others go on.

        A step with one request is its fault. A step with several has its requests
        preempted and rerun, half of them at a time, until one fails alone (the scheduler's
        bisection, core/sched/failure_isolator.py); the others complete with their own tokens.
        Failures that no request can be blamed for, several in a row, mean the engine
        itself is broken: then it raises, and the core dies (the server reports it and
        exits).
        """
        message = f"{type(error).__name__}: {error}"
        outputs = self.scheduler.isolate_failed_step(scheduler_output, message)
        if self.config.scheduler_config.async_scheduling:
            # The steps sent after it ran on its placeholders: void, whatever they did.
            while self.batch_queue:
                later = self.batch_queue.pop_oldest()
                with contextlib.suppress(Exception):
                    later.output.result()
                self.scheduler.discard_step(later.scheduler_output)
        self._publish_kv_events()  # the failed step's blocks left the prefix cache
        if self.scheduler.isolator.engine_is_broken:
            raise error
        logger.exception(
            "a model step of %d request(s) failed; %s",
            len(scheduler_output.num_scheduled_tokens),
            f"request {outputs[-1].request_id} ends with an error"
            if outputs
            else "its requests rerun to find the one it is due to",
            exc_info=error,
        )
        return EngineCoreOutputs(
            outputs=outputs, scheduler_stats=self.make_stats(), timestamp=time.monotonic()
        )

    def make_stats(self) -> SchedulerStats | None:
        """The scheduler's stats with the step-time totals (None when stats are off)."""
        stats = self.scheduler.make_stats()
        if stats is not None and self.step_times is not None:
            # A copy: in-process clients keep the message while the totals move on.
            stats.step_times = msgspec.structs.replace(self.step_times)
        return stats

    def _publish_kv_events(self) -> None:
        # The block pool only makes the three KVEvent kinds; its queue is typed by their base.
        events = cast("list[KVEvent]", self.scheduler.take_kv_events())
        if events:
            batch = KVEventBatch(ts=time.time(), events=events)
            self.kv_event_publisher.publish(batch)
            self.in_band_kv_events.publish(batch)

    def reset_prefix_cache(self) -> bool:
        reset = self.scheduler.reset_prefix_cache()
        self._publish_kv_events()
        return reset

    def sleep(self, level: int = 1) -> bool:
        """vLLM's sleep: every worker frees its KV cache (and its weights, level 2); the
        prefix cache, whose blocks' contents go, is reset. Only an idle engine sleeps
        (ValueError otherwise): its requests' KV would go with it. True: asleep."""
        if not self.config.model_config.enable_sleep_mode:
            raise ValueError("sleep mode is off: start the engine with enable_sleep_mode")
        check_sleep_level(level)
        # Finished requests the workers have yet to hear of are no obstacle: their blocks
        # are free, and the next step tells the workers.
        self._drain_finished()
        unfinished = self.scheduler.get_num_unfinished_requests()
        if unfinished or self.batch_queue:
            raise ValueError(
                f"cannot sleep with {unfinished} request(s) in flight: "
                "let them finish or abort them first"
            )
        # Every cached block's contents go: none may be found by its hash after waking.
        if not self.reset_prefix_cache():
            raise ValueError("cannot sleep while KV blocks are in use (transfers in flight)")
        freed = sum(self.model_executor.collective_rpc("sleep", args=(level,)))
        self.asleep_tags = set(SLEEP_TAGS)
        logger.info("sleeping at level %d: %.1f MiB freed across workers", level, freed / 2**20)
        return True

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Gives the workers back what sleep freed, for ``tags`` (None: all of
        SLEEP_TAGS); returns whether some tag still sleeps."""
        tags = check_wake_tags(tags)
        self.model_executor.collective_rpc("wake_up", args=(tags,))
        self.asleep_tags.difference_update(tags)
        logger.info("woke up %s; still asleep: %s", tags, sorted(self.asleep_tags) or "none")
        return self.is_sleeping()

    def is_sleeping(self) -> bool:
        return bool(self.asleep_tags)

    def request_census(self) -> dict[str, dict[str, int]]:
        """Per process ("engine_core", "worker_<rank>"): the live per-request entries of
        every owner and the per-request objects alive (see utils/census.py). A worker in
        this process shares its object counts, so they are counted once, here."""
        core: dict[str, int] = {
            **prefixed("scheduler", self.scheduler.request_census()),
            **prefixed("structured_output", self.structured_output_manager.request_census()),
            "batch_queue.batches": len(self.batch_queue.batches),
        }
        censuses = {"engine_core": core}
        for rank, worker in enumerate(self.model_executor.collective_rpc("request_census")):
            owners = prefixed("model_runner", worker["owners"])
            if worker["pid"] == os.getpid():
                core.update(prefixed(f"worker_{rank}", owners))
            else:
                censuses[f"worker_{rank}"] = {**owners, **worker["objects"]}
        core.update(per_request_objects())
        return censuses

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self.structured_output_manager.shutdown()
        self.model_executor.shutdown()
        self.kv_event_publisher.shutdown()
        gc.unfreeze()


def log_thread_settings(role: str) -> None:
    """Logs what this process runs with, as torch sees it."""
    logging.getLogger("kvserve.startup").info(
        "threads (%s): %d usable cores, torch intra-op threads %d, OMP_NUM_THREADS=%s, "
        "OMP_WAIT_POLICY=%s, GOMP_SPINCOUNT=%s",
        role,
        usable_cores(),
        torch.get_num_threads(),
        os.environ.get("OMP_NUM_THREADS", "unset"),
        os.environ.get("OMP_WAIT_POLICY", "unset"),
        os.environ.get("GOMP_SPINCOUNT", "unset"),
    )
