"""Data parallelism: several engine cores behind one front end (vLLM's DP clients).

Each core is an EngineCoreProc with its own scheduler, KV cache and tensor/pipeline
workers, told its rank (ParallelConfig.data_parallel_rank, which also offsets its KV
event ports). The client launches them all, sends each new request to one core (the
DPLoadBalancer's choice; a parent's n > 1 children all to the same one, so they share
its prefix cache), merges their outputs into one stream (every core's MP client puts
into one queue, and each output says which core sent it), routes an abort to the core
that owns the request, and sends utility calls (reset_prefix_cache, sleep, census, ...)
to every core.

A core that dies takes the engine down (EngineDeadError, as one core's death does),
unless ``data_parallel_tolerate_failure``: then its requests end with an error that
starts with ENGINE_CORE_DIED_PREFIX (the server answers 503), it takes no new ones, and
the others keep serving until none is left.

DPClient here is the blocking client (LLMEngine); DPAsyncClient (dp_async_client.py) the
asyncio one (AsyncLLM). This module holds what they share.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import queue
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from kvserve.config import EngineConfig
from kvserve.engine.core_client import EngineCoreClient
from kvserve.engine.core_launcher import CoreStartupHandle
from kvserve.engine.dp_balancer import DPLoadBalancer
from kvserve.engine.dp_launcher import DPCoreLauncher
from kvserve.engine.exceptions import EngineDeadError
from kvserve.engine.mp_client import SyncMPClient
from kvserve.protocol.engine_core import (
    ENGINE_CORE_DIED_PREFIX,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)

if TYPE_CHECKING:
    from kvserve.executor.abstract import Executor

logger = logging.getLogger(__name__)

ClientT = TypeVar("ClientT")


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """Core ``rank``'s copy of the config (a shallow copy: the rest is shared, read-only)."""
    ranked = copy.copy(config)
    ranked.parallel_config = dataclasses.replace(config.parallel_config, data_parallel_rank=rank)
    return ranked


def start_cores(
    launcher: DPCoreLauncher,
    make_client: Callable[[EngineConfig, CoreStartupHandle], ClientT],
    while_starting: Sequence[Callable[[], object]],
) -> list[ClientT]:
    """One client per rank. All the processes are spawned first (or the remote cores
    asked for) and load their models at once (each client waits for its handshake on a
    thread of its own) while ``while_starting`` runs here; a core that fails to start
    stops the others."""
    config = launcher.config
    size = config.parallel_config.data_parallel_size
    startups = [launcher.startup(rank) for rank in range(size)]
    clients: list[ClientT] = []
    errors: list[BaseException] = []
    with ThreadPoolExecutor(size, thread_name_prefix="DPCoreStart") as pool:
        futures = [
            pool.submit(make_client, rank_config(config, rank), startup)
            for rank, startup in enumerate(startups)
        ]
        try:
            for step in while_starting:
                step()
        except BaseException as e:
            errors.append(e)
        for future in futures:
            try:
                clients.append(future.result())
            except BaseException as e:
                errors.append(e)
    if errors:
        for client in clients:
            client.shutdown()  # type: ignore[attr-defined]
        launcher.close()
        raise errors[0]
    logger.info("%d data-parallel engine cores ready", size)
    return clients


def dead_core_message(core: int, reason: str) -> str:
    return f"{ENGINE_CORE_DIED_PREFIX}: data-parallel rank {core} ({reason})"


def failed_outputs(core: int, request_ids: list[str], reason: str) -> EngineCoreOutputs:
    """The end of a dead core's requests, as if it had sent them (tolerate_failure)."""
    error = dead_core_message(core, reason)
    return EngineCoreOutputs(
        outputs=[
            EngineCoreOutput(
                request_id=r, new_token_ids=[], finish_reason=FinishReason.ERROR, error=error
            )
            for r in request_ids
        ],
        # Zeros: the dead core's gauges (requests running, KV usage) must not linger.
        scheduler_stats=SchedulerStats(),
        timestamp=time.monotonic(),
        engine_index=core,
    )


def merge_stats(stats: Sequence[SchedulerStats]) -> SchedulerStats:
    """The fleet's counts: sums, and the mean KV cache usage."""
    merged = SchedulerStats()
    for s in stats:
        merged.num_running_reqs += s.num_running_reqs
        merged.num_waiting_reqs += s.num_waiting_reqs
        merged.kv_cache_blocks_in_use += s.kv_cache_blocks_in_use
        merged.prefix_cache_queries += s.prefix_cache_queries
        merged.prefix_cache_hits += s.prefix_cache_hits
        merged.num_preemptions += s.num_preemptions
        merged.kv_cache_usage += s.kv_cache_usage / len(stats)
    return merged


def merge_census(censuses: Sequence[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    """Every core's processes, named with their rank."""
    merged: dict[str, dict[str, int]] = {}
    for rank, census in enumerate(censuses):
        for process, counts in census.items():
            merged[f"{process}.dp{rank}"] = counts
    return merged


class DPFailures:
    """What the engine does when a core dies: give up (the default), or fail the core's
    requests and go on with the others (tolerate_failure)."""

    def __init__(self, balancer: DPLoadBalancer, tolerate: bool) -> None:
        self.balancer = balancer
        self.tolerate = tolerate
        self.dead: dict[int, str] = {}

    def on_dead(self, error: EngineDeadError) -> EngineCoreOutputs:
        """A core's EngineDeadError from the output stream: the outputs that end its
        requests, or the error (raised) that ends the engine."""
        core = error.engine_index
        if core is None:  # the engine was shut down
            raise error
        reason = str(error)
        self.dead[core] = reason
        if not self.tolerate:
            raise EngineDeadError(dead_core_message(core, reason), engine_index=core)
        lost = self.balancer.mark_dead(core)
        if not self.balancer.alive:
            raise EngineDeadError(f"every data-parallel engine core died; the last: {reason}")
        logger.error(
            "data-parallel engine core %d died (%s): %d request(s) fail, %d core(s) go on",
            core,
            reason,
            len(lost),
            len(self.balancer.alive),
        )
        return failed_outputs(core, lost, reason)


class DPClient(EngineCoreClient):
    """The blocking DP client: N SyncMPClients that share one output queue."""

    def __init__(
        self,
        config: EngineConfig,
        log_stats: bool = True,
        *,
        while_starting: Callable[[], object] | None = None,
    ) -> None:
        self.config = config
        self.outputs_queue: queue.Queue[EngineCoreOutputs | Exception] = queue.Queue()
        self.balancer = DPLoadBalancer.from_config(config)
        self.failures = DPFailures(
            self.balancer, config.parallel_config.data_parallel_tolerate_failure
        )

        def make(ranked: EngineConfig, startup: CoreStartupHandle) -> SyncMPClient:
            return SyncMPClient(
                ranked, log_stats, outputs_queue=self.outputs_queue, startup=startup
            )

        self.launcher = DPCoreLauncher(config, rank_config)
        self.cores = start_cores(self.launcher, make, [while_starting] if while_starting else [])

    def _alive_cores(self) -> list[SyncMPClient]:
        return [self.cores[i] for i in self.balancer.alive]

    def add_request(self, request: EngineCoreRequest) -> None:
        self.add_requests([request])

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        core = self.balancer.choose(requests[0])
        self.balancer.assign([r.request_id for r in requests], core)
        for request in requests:
            self.cores[core].add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        for core, ids in self.balancer.by_owner(request_ids).items():
            if core in self.balancer.alive:
                self.cores[core].abort_requests(ids)

    def get_output(self) -> EngineCoreOutputs:
        output = self.outputs_queue.get()
        if isinstance(output, EngineDeadError):
            try:
                return self.failures.on_dead(output)
            except EngineDeadError as fatal:
                self.outputs_queue.put(fatal)  # later callers fail too
                raise
        if isinstance(output, Exception):
            self.outputs_queue.put(output)
            raise output
        self.balancer.on_outputs(output)
        return output

    def reset_prefix_cache(self) -> bool:
        return all([core.reset_prefix_cache() for core in self._alive_cores()])

    def get_stats(self) -> SchedulerStats:
        return merge_stats([core.get_stats() for core in self._alive_cores()])

    def get_stats_per_core(self) -> dict[int, SchedulerStats]:
        return {i: self.cores[i].get_stats() for i in self.balancer.alive}

    def request_census(self) -> dict[str, dict[str, int]]:
        return merge_census([core.request_census() for core in self._alive_cores()])

    def sleep(self, level: int) -> bool:
        return all([core.sleep(level) for core in self._alive_cores()])

    def wake_up(self, tags: list[str] | None) -> bool:
        return any([core.wake_up(tags) for core in self._alive_cores()])

    def is_sleeping(self) -> bool:
        return any(core.is_sleeping() for core in self._alive_cores())

    def in_process_executor(self) -> Executor:
        return self.cores[0].in_process_executor()  # raises: no core is in this process

    def shutdown(self) -> None:
        for core in self.cores:
            core.shutdown()
        self.launcher.close()

    def call_utility(self, method: str, *args: Any) -> list[Any]:
        """A utility call to every live core; their answers by rank."""
        return [core.call_utility(method, *args) for core in self._alive_cores()]
