"""Clients that run the EngineCore in a background process and talk to it over ZMQ.

SyncMPClient (blocking, for LLMEngine) lives here; AsyncMPClient (asyncio, for AsyncLLM)
in async_mp_client.py. Both build on MPClient: it binds the two sockets, starts
EngineCoreProc (core_launcher.py: `kvserve serve` spawns it before its config exists),
waits for its handshake and watches its process sentinel, so a dead core fails every
pending and later call with EngineDeadError instead of leaving the caller blocked on a
socket nobody writes to.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import tempfile
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import zmq
import zmq.asyncio

from kvserve.config import EngineConfig
from kvserve.engine.core_client import EngineCoreClient
from kvserve.engine.core_launcher import CoreStartupHandle, claim_engine_core
from kvserve.engine.exceptions import EngineDeadError
from kvserve.protocol.core_messages import (
    AbortRequestsMessage,
    AddRequestMessage,
    HandshakeMessage,
    InputMessage,
    OutputMessage,
    OutputsMessage,
    ReadyMessage,
    StartupErrorMessage,
    UtilityCallMessage,
    UtilityResultMessage,
)
from kvserve.protocol.engine_core import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from kvserve.utils.processes import ChildResources, ProcessHandle, startup_error, wait_for_handshake
from kvserve.utils.startup import log_phase

if TYPE_CHECKING:
    from kvserve.executor.abstract import Executor

logger = logging.getLogger(__name__)


class MPClient(ABC):
    """Process launch, handshake, wire encoding and shutdown shared by both MP clients;
    each also implements its caller's protocol (EngineCoreClient, AsyncEngineCoreClient)."""

    def __init__(
        self,
        config: EngineConfig,
        log_stats: bool = True,
        *,
        asyncio_mode: bool,
        transport: Literal["ipc", "tcp"] = "ipc",
        startup_timeout: float | None = None,
        while_starting: Callable[[], object] | None = None,
        also_while_starting: Callable[[], object] | None = None,
        startup: CoreStartupHandle | None = None,
    ) -> None:
        """Spawns the core and blocks until it is ready (or raises its startup error).

        ``while_starting`` runs in this process while the core loads the model, to overlap
        front-end setup (e.g. loading the tokenizer) with it; ``also_while_starting``
        after it, for its caller's own setup (e.g. the server importing its web stack).
        ``startup``: a core process already spawned for this client (data parallelism
        spawns all its cores first, so their imports overlap).
        """
        self.config = config
        self.engine_index = config.parallel_config.data_parallel_rank
        self._startup = startup
        self.log_stats = log_stats
        self.engine_dead = False
        self.dead_reason: str | None = None
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(OutputMessage)
        self._call_ids = itertools.count()
        # Utility calls awaiting their result: concurrent.futures or asyncio futures.
        self._pending: dict[int, Any] = {}
        ctx: zmq.Context[Any] = zmq.asyncio.Context() if asyncio_mode else zmq.Context()
        self.input_socket = ctx.socket(zmq.PUSH)
        self.output_socket = ctx.socket(zmq.PULL)
        if startup is not None:
            transport = startup.transport
        tmpdir = tempfile.mkdtemp(prefix="kvserve-") if transport == "ipc" else None
        self.resources = ChildResources(
            ctx, [self.input_socket, self.output_socket], tmpdir=tmpdir, stop_grace_s=5.0
        )
        self._finalizer = weakref.finalize(self, self.resources)
        try:
            # A core on another node reaches the front end at its data-parallel address.
            host = config.parallel_config.data_parallel_address or "127.0.0.1"
            input_address = _bind(self.input_socket, tmpdir, "input", host)
            output_address = _bind(self.output_socket, tmpdir, "output", host)
            self.proc = self._start_proc(
                input_address,
                output_address,
                startup_timeout,
                [step for step in (while_starting, also_while_starting) if step is not None],
            )
        except BaseException:
            self._finalizer()
            raise

    def _start_proc(
        self,
        input_address: str,
        output_address: str,
        timeout: float | None,
        while_starting: list[Callable[[], object]],
    ) -> ProcessHandle:
        startup = self._startup or claim_engine_core()
        self._startup = None
        proc = startup.proc
        self.resources.procs.append(proc)
        startup.send_config(
            self.config,
            input_address,
            output_address,
            logging.getLogger("kvserve").getEffectiveLevel(),
        )
        try:
            for step in while_starting:
                step()
            handshake = wait_for_handshake(startup.ready_reader, proc, timeout, "EngineCore")
            self.ready = _ready(handshake, proc)
        finally:
            startup.ready_reader.close()
        log_phase("engine core process ready", time.perf_counter() - startup.started, pid=proc.pid)
        logger.info(
            "EngineCore process %d ready: %d KV blocks of %d tokens",
            proc.pid,
            self.ready.num_gpu_blocks,
            self.ready.block_size,
        )
        return proc

    # --- shared helpers ----------------------------------------------------------------

    def is_alive(self) -> bool:
        return not self.engine_dead and not self.resources.closed and self.proc.is_alive()

    def check_alive(self) -> None:
        if self.resources.closed:
            raise EngineDeadError("the engine core has been shut down")
        if self.engine_dead or not self.proc.is_alive():
            raise EngineDeadError(self.dead_reason)

    def _encode(self, message: InputMessage) -> bytes:
        return self.encoder.encode(message)

    def _next_call_id(self) -> int:
        return next(self._call_ids)

    @abstractmethod
    def _put_output(self, output: EngineCoreOutputs | Exception) -> None:
        """Hands the reader's output (or the error that ends the stream) to get_output."""

    def _handle(self, message: OutputMessage) -> None:
        if isinstance(message, OutputsMessage):
            self._put_output(message.outputs)
        elif isinstance(message, UtilityResultMessage):
            future = self._pending.pop(message.call_id, None)
            if future is not None and not future.done():
                if message.error is None:
                    future.set_result(message.result)
                else:
                    future.set_exception(RuntimeError(message.error))
        else:  # EngineErrorMessage: the core's last words before it exits
            self.dead_reason = message.error

    def _fail_pending(self, error: Exception) -> None:
        for call_id in list(self._pending):
            future = self._pending.pop(call_id, None)
            if future is not None and not future.done():
                future.set_exception(error)

    def _mark_dead(self) -> None:
        """The core process exited on its own: fail everything waiting on it."""
        if self.engine_dead or self.resources.closed:
            return
        self.engine_dead = True
        self.proc.join(1)  # it has exited (sentinel): reaping is immediate
        logger.error(
            "EngineCore process %d (data-parallel rank %d) died (exit code %s)",
            self.proc.pid,
            self.engine_index,
            self.proc.exitcode,
        )
        error = EngineDeadError(self.dead_reason, engine_index=self.engine_index)
        self._put_output(error)
        self._fail_pending(error)

    def shutdown(self) -> None:
        self._finalizer()


def _bind(sock: zmq.Socket[Any], tmpdir: str | None, name: str, host: str) -> str:
    if tmpdir is not None:
        address = f"ipc://{tmpdir}/{name}.sock"
        sock.bind(address)
        return address
    sock.bind(f"tcp://{host}:*")
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _ready(data: bytes, proc: ProcessHandle) -> ReadyMessage:
    message = msgspec.msgpack.decode(data, type=HandshakeMessage)
    if isinstance(message, StartupErrorMessage):
        proc.join(5)  # it exits on its own after saying why
        logger.debug("EngineCore startup traceback:\n%s", message.traceback)
        raise startup_error(message.error_type, message.error)
    return message


class SyncMPClient(MPClient, EngineCoreClient):
    """Blocking client: a thread reads the output socket and watches the process."""

    def __init__(
        self,
        config: EngineConfig,
        log_stats: bool = True,
        *,
        outputs_queue: queue.Queue[EngineCoreOutputs | Exception] | None = None,
        **kwargs: Any,
    ) -> None:
        """``outputs_queue``: where outputs go (shared by data-parallel cores; default:
        one of its own)."""
        super().__init__(config, log_stats, asyncio_mode=False, **kwargs)
        self.outputs_queue = outputs_queue if outputs_queue is not None else queue.Queue()
        self._send_lock = threading.Lock()
        # Writing to this pipe wakes the output thread for a clean exit.
        self._stop_r, self._stop_w = os.pipe()
        self.resources.fds += [self._stop_r, self._stop_w]
        thread = threading.Thread(target=self._output_loop, name="EngineCoreOutput", daemon=True)
        self.resources.thread, self.resources.wake_fd = thread, self._stop_w
        thread.start()

    def _output_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.output_socket, zmq.POLLIN)
        poller.register(self.proc.sentinel, zmq.POLLIN)
        poller.register(self._stop_r, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self._stop_r in events:
                return
            if self.output_socket in events:
                # Drain before looking at the sentinel: the core's last words come first.
                while self.output_socket.poll(0):
                    self._handle(self.decoder.decode(self.output_socket.recv()))
                continue
            if self.proc.sentinel in events:
                self._mark_dead()
                return

    def _put_output(self, output: EngineCoreOutputs | Exception) -> None:
        self.outputs_queue.put(output)

    def _send(self, message: InputMessage) -> None:
        frame = self._encode(message)
        with self._send_lock:
            while True:
                self.check_alive()
                try:
                    self.input_socket.send(frame, zmq.NOBLOCK)
                    return
                except zmq.Again:
                    time.sleep(0.001)  # the core is mid-step with a full queue

    def get_output(self) -> EngineCoreOutputs:
        if self.resources.closed or (self.engine_dead and self.outputs_queue.empty()):
            self.check_alive()
        output = self.outputs_queue.get()
        if isinstance(output, Exception):
            self.outputs_queue.put(output)  # later callers fail too
            raise output
        return output

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(AddRequestMessage(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(AbortRequestsMessage(list(request_ids)))

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        call_id = self._next_call_id()
        future: Future[Any] = Future()
        self._pending[call_id] = future
        try:
            self._send(UtilityCallMessage(call_id, method, list(args)))
        except BaseException:
            self._pending.pop(call_id, None)
            raise
        return future.result(timeout)

    def reset_prefix_cache(self) -> bool:
        return bool(self.call_utility("reset_prefix_cache"))

    def get_stats(self) -> SchedulerStats:
        return msgspec.convert(self.call_utility("get_stats"), SchedulerStats)

    def request_census(self) -> dict[str, dict[str, int]]:
        return dict(self.call_utility("request_census"))

    def sleep(self, level: int) -> bool:
        return bool(self.call_utility("sleep", level))

    def wake_up(self, tags: list[str] | None) -> bool:
        return bool(self.call_utility("wake_up", tags))

    def is_sleeping(self) -> bool:
        return bool(self.call_utility("is_sleeping"))

    def in_process_executor(self) -> Executor:
        # A callable and arbitrary arguments reach another process only as pickles,
        # which kvserve never sends.
        raise ValueError(
            "collective_rpc needs the engine core in this process "
            "(LLM(..., multiprocess_mode=False), the default)"
        )

    def shutdown(self) -> None:
        super().shutdown()
        # Wake anyone still blocked in get_output().
        self.outputs_queue.put(EngineDeadError("the engine core has been shut down"))
