"""AsyncMPClient: the asyncio client of an EngineCoreProc, used by AsyncLLM.

One task reads the output socket; the event loop watches the process sentinel, so a dead
core fails pending and later calls with EngineDeadError within a few milliseconds.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import zmq

from kvserve.config import EngineConfig
from kvserve.engine.core_client import AsyncEngineCoreClient
from kvserve.engine.exceptions import EngineDeadError
from kvserve.engine.mp_client import MPClient
from kvserve.protocol.core_messages import (
    AbortRequestsMessage,
    AddRequestMessage,
    InputMessage,
    UtilityCallMessage,
)
from kvserve.protocol.engine_core import EngineCoreOutputs, EngineCoreRequest, SchedulerStats


class AsyncMPClient(MPClient, AsyncEngineCoreClient):
    """asyncio client: one task reads outputs; the loop watches the process sentinel.

    It binds to the event loop of its first awaited call; use one instance per loop.
    """

    def __init__(
        self,
        config: EngineConfig,
        log_stats: bool = True,
        *,
        outputs_queue: asyncio.Queue[EngineCoreOutputs | Exception] | None = None,
        **kwargs: Any,
    ) -> None:
        """``outputs_queue``: where outputs go (shared by data-parallel cores; default:
        one of its own)."""
        super().__init__(config, log_stats, asyncio_mode=True, **kwargs)
        self.outputs_queue = outputs_queue if outputs_queue is not None else asyncio.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._output_task: asyncio.Task[None] | None = None

    def _ensure_started(self) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._output_task = self._loop.create_task(self._output_loop(), name="EngineCoreOutput")
        self._loop.add_reader(self.proc.sentinel, self._on_proc_exit)

    async def _output_loop(self) -> None:
        while True:
            frame = await self.output_socket.recv()
            self._handle(self.decoder.decode(frame))

    def _put_output(self, output: EngineCoreOutputs | Exception) -> None:
        self.outputs_queue.put_nowait(output)

    def _on_proc_exit(self) -> None:
        assert self._loop is not None
        self._loop.remove_reader(self.proc.sentinel)
        if self.resources.closed:
            return
        # A moment for the output task to read frames the core sent before exiting.
        self._loop.call_later(0.05, self._mark_dead)

    def _mark_dead(self) -> None:
        super()._mark_dead()
        if self.engine_dead and self._output_task is not None:
            self._output_task.cancel()

    async def _send(self, message: InputMessage) -> None:
        self._ensure_started()
        frame = self._encode(message)
        while True:
            self.check_alive()
            try:
                await self.input_socket.send(frame, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                await asyncio.sleep(0.001)  # the core is mid-step with a full queue

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_started()
        if self.resources.closed or (self.engine_dead and self.outputs_queue.empty()):
            self.check_alive()
        output = await self.outputs_queue.get()
        if isinstance(output, Exception):
            self.outputs_queue.put_nowait(output)
            raise output
        return output

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self._send(AddRequestMessage(request))

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids:
            await self._send(AbortRequestsMessage(list(request_ids)))

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        self._ensure_started()
        assert self._loop is not None
        call_id = self._next_call_id()
        future: asyncio.Future[Any] = self._loop.create_future()
        self._pending[call_id] = future
        try:
            await self._send(UtilityCallMessage(call_id, method, list(args)))
            return await future
        finally:
            self._pending.pop(call_id, None)

    async def reset_prefix_cache_async(self) -> bool:
        return bool(await self.call_utility_async("reset_prefix_cache"))

    async def get_stats_async(self) -> SchedulerStats:
        return msgspec.convert(await self.call_utility_async("get_stats"), SchedulerStats)

    async def request_census_async(self) -> dict[str, dict[str, int]]:
        return dict(await self.call_utility_async("request_census"))

    async def sleep_async(self, level: int) -> bool:
        return bool(await self.call_utility_async("sleep", level))

    async def wake_up_async(self, tags: list[str] | None) -> bool:
        return bool(await self.call_utility_async("wake_up", tags))

    async def is_sleeping_async(self) -> bool:
        return bool(await self.call_utility_async("is_sleeping"))

    def shutdown(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            if self._output_task is not None:
                self._output_task.cancel()
            self._loop.remove_reader(self.proc.sentinel)
        self._fail_pending(EngineDeadError("the engine core has been shut down"))
        super().shutdown()
