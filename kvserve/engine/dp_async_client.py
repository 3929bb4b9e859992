"""DPAsyncClient: AsyncLLM's data-parallel client, N AsyncMPClients behind one stream
(see dp_client.py for the routing, the merged stream and what a dead core does)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kvserve.config import EngineConfig
from kvserve.engine.async_mp_client import AsyncMPClient
from kvserve.engine.core_client import AsyncEngineCoreClient
from kvserve.engine.core_launcher import CoreStartupHandle
from kvserve.engine.dp_balancer import DPLoadBalancer
from kvserve.engine.dp_client import (
    DPFailures,
    merge_census,
    merge_stats,
    rank_config,
    start_cores,
)
from kvserve.engine.dp_launcher import DPCoreLauncher
from kvserve.engine.exceptions import EngineDeadError
from kvserve.protocol.engine_core import EngineCoreOutputs, EngineCoreRequest, SchedulerStats


class DPAsyncClient(AsyncEngineCoreClient):
    """Binds to the event loop of its first awaited call, like AsyncMPClient."""

    def __init__(
        self,
        config: EngineConfig,
        log_stats: bool = True,
        *,
        while_starting: Callable[[], object] | None = None,
        also_while_starting: Callable[[], object] | None = None,
        **kwargs: Any,
    ) -> None:
        self.config = config
        self.outputs_queue: asyncio.Queue[EngineCoreOutputs | Exception] = asyncio.Queue()
        self.balancer = DPLoadBalancer.from_config(config)
        self.failures = DPFailures(
            self.balancer, config.parallel_config.data_parallel_tolerate_failure
        )

        def make(ranked: EngineConfig, startup: CoreStartupHandle) -> AsyncMPClient:
            return AsyncMPClient(
                ranked, log_stats, outputs_queue=self.outputs_queue, startup=startup, **kwargs
            )

        steps = [step for step in (while_starting, also_while_starting) if step is not None]
        self.launcher = DPCoreLauncher(config, rank_config)
        self.cores = start_cores(self.launcher, make, steps)

    @property
    def dead_reason(self) -> str | None:  # type: ignore[override]
        """Which cores died and why (their exit codes, if the stream has not said yet)."""
        reasons = dict(self.failures.dead)
        for rank, core in enumerate(self.cores):
            if rank not in reasons and not core.is_alive():
                reasons[rank] = core.dead_reason or f"exit code {core.proc.exitcode}"
        if not reasons:
            return None
        return "; ".join(f"data-parallel rank {r}: {why}" for r, why in sorted(reasons.items()))

    def is_alive(self) -> bool:
        """Every core is alive; with tolerate_failure, some core is."""
        alive = [core.is_alive() for core in self.cores]
        return any(alive) if self.failures.tolerate else all(alive)

    def _alive_cores(self) -> list[AsyncMPClient]:
        return [self.cores[i] for i in self.balancer.alive]

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self.add_requests_async([request])

    async def add_requests_async(self, requests: list[EngineCoreRequest]) -> None:
        for client in self.cores:
            client._ensure_started()  # every core's sentinel is watched from the first call
        rank = self.balancer.choose(requests[0])
        self.balancer.assign([r.request_id for r in requests], rank)
        for request in requests:
            await self.cores[rank].add_request_async(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        for core, ids in self.balancer.by_owner(request_ids).items():
            if core in self.balancer.alive:
                await self.cores[core].abort_requests_async(ids)

    async def get_output_async(self) -> EngineCoreOutputs:
        for core in self.cores:
            core._ensure_started()
        output = await self.outputs_queue.get()
        if isinstance(output, EngineDeadError):
            try:
                return self.failures.on_dead(output)
            except EngineDeadError as fatal:
                self.outputs_queue.put_nowait(fatal)  # later callers fail too
                raise
        if isinstance(output, Exception):
            self.outputs_queue.put_nowait(output)
            raise output
        self.balancer.on_outputs(output)
        return output

    async def reset_prefix_cache_async(self) -> bool:
        results = [await core.reset_prefix_cache_async() for core in self._alive_cores()]
        return all(results)

    async def get_stats_async(self) -> SchedulerStats:
        return merge_stats([await core.get_stats_async() for core in self._alive_cores()])

    async def get_stats_per_core_async(self) -> dict[int, SchedulerStats]:
        return {i: await self.cores[i].get_stats_async() for i in self.balancer.alive}

    async def request_census_async(self) -> dict[str, dict[str, int]]:
        return merge_census([await core.request_census_async() for core in self._alive_cores()])

    async def sleep_async(self, level: int) -> bool:
        return all([await core.sleep_async(level) for core in self._alive_cores()])

    async def wake_up_async(self, tags: list[str] | None) -> bool:
        return any([await core.wake_up_async(tags) for core in self._alive_cores()])

    async def is_sleeping_async(self) -> bool:
        return any([await core.is_sleeping_async() for core in self._alive_cores()])

    def shutdown(self) -> None:
        for core in self.cores:
            core.shutdown()
        self.launcher.close()
