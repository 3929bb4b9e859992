"""EngineCoreProc: the EngineCore in its own process, fed and drained over ZMQ.

Wire format (protocol/core_messages.py): every frame is one msgpack-encoded msgspec Struct from a tagged union
(``InputMessage`` client -> core, ``OutputMessage`` core -> client), decoded against
that union, so nothing on either socket is ever unpickled. The startup handshake
(``ReadyMessage`` or ``StartupErrorMessage``) travels as msgpack bytes over a one-way
multiprocessing pipe, which the parent can wait on together with the process sentinel.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
import zmq

from kvserve.config import EngineConfig
from kvserve.engine_core.core import EngineCore
from kvserve.engine_core.dp_wave import PeerCoreExitedError, make_dp_wave
from kvserve.protocol.core_messages import (
    AbortRequestsMessage,
    AddRequestMessage,
    EngineErrorMessage,
    InputMessage,
    OutputsMessage,
    ReadyMessage,
    StartupErrorMessage,
    UtilityCallMessage,
    UtilityResultMessage,
)
from kvserve.protocol.engine_core import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    SchedulerStats,
)
from kvserve.utils import memory_trace
from kvserve.utils.allocator import running_allocator
from kvserve.utils.heap_trim import HeapTrimmer
from kvserve.utils.startup import log_phase

logger = logging.getLogger(__name__)


class ReadyWriter(Protocol):
    """Where the core's handshake goes: its pipe to the parent (a Connection), or its
    ZMQ link to a front end on another node (engine_core/remote_core.py)."""

    def send_bytes(self, buf: bytes) -> None: ...
    def close(self) -> None: ...


class EngineCoreProc:
    """Runs inside the child process: busy loop of drain inputs -> step -> send outputs."""

    def __init__(
        self,
        config: EngineConfig,
        input_address: str,
        output_address: str,
        stop_fd: int | None = None,
    ) -> None:
        """``stop_fd``: readable when the core must exit (a core the front end did not
        spawn: its link to the front end is gone or asked it to stop; dp_remote.py)."""
        # Stats are always on here: they ride on every output message and cost a few ints.
        self.engine_core: EngineCore = EngineCore(config, log_stats=True)
        self.scheduler = self.engine_core.scheduler
        self.engine_index = config.parallel_config.data_parallel_rank
        # Cores that share MoE layers step together (dp_wave.py); else a no-op.
        self.wave = make_dp_wave(config.parallel_config)
        self.stop_requested = False  # a signal that came mid-step, in lockstep
        self.ctx = zmq.Context()
        self.input_socket = self.ctx.socket(zmq.PULL)
        self.input_socket.connect(input_address)
        self.output_socket = self.ctx.socket(zmq.PUSH)
        self.output_socket.connect(output_address)
        self.decoder = msgspec.msgpack.Decoder(InputMessage)
        self.encoder = msgspec.msgpack.Encoder()
        self.poller = zmq.Poller()
        self.poller.register(self.input_socket, zmq.POLLIN)
        # If the front end dies without shutting us down, its sentinel becomes readable.
        parent = multiprocessing.parent_process()
        self.parent_sentinel = parent.sentinel if parent is not None else None
        if self.parent_sentinel is not None:
            self.poller.register(self.parent_sentinel, zmq.POLLIN)
        self.stop_fd = stop_fd
        if stop_fd is not None:
            self.poller.register(stop_fd, zmq.POLLIN)
        # Worker processes (mp executor): a lost one ends the core at once, even when idle.
        self.executor_failure_fd = self.engine_core.model_executor.failure_fd()
        if self.executor_failure_fd is not None:
            self.poller.register(self.executor_failure_fd, zmq.POLLIN)
        # Prefix-cache counts consumed by an out-of-band get_stats, owed to the stream.
        self._carried_queries = 0
        self._carried_hits = 0
        self._utilities: dict[str, Callable[..., Any]] = {
            "reset_prefix_cache": self.engine_core.reset_prefix_cache,
            "request_census": self.engine_core.request_census,
            "sleep": self.engine_core.sleep,
            "wake_up": self.engine_core.wake_up,
            "is_sleeping": self.engine_core.is_sleeping,
            "get_stats": self._snapshot_stats,
            "ping": lambda: "pong",
            "collective_rpc": self._worker_rpc,
        }

    def _worker_rpc(self, method: str, *args: Any) -> list[Any]:
        """A Worker method on every worker of this core (vLLM's collective_rpc utility);
        by name only, never a function path, since the name comes off a socket."""
        if ":" in method or method.startswith("_"):
            raise ValueError(f"collective_rpc takes a public Worker method name, got {method!r}")
        return list(self.engine_core.model_executor.collective_rpc(method, args=args))

    def ready_message(self) -> ReadyMessage:
        config = self.engine_core.config
        return ReadyMessage(
            num_gpu_blocks=self.engine_core.kv_cache_config.num_blocks,
            block_size=config.cache_config.block_size,
            max_model_len=config.model_config.max_model_len or 0,
        )

    # --- the loop --------------------------------------------------------------------

    def run_busy_loop(self) -> None:
        heap = HeapTrimmer()
        logger.info("engine core allocator: %s", running_allocator())
        while True:
            if self.stop_requested:
                raise SystemExit(0)
            busy = self.engine_core.has_work()
            if not busy:
                heap.before_idle()
            # Block (no spin) when idle; when busy only peek, so the step is not delayed.
            events = dict(self.poller.poll(self.wave.poll_timeout_ms(busy)))
            if self.parent_sentinel is not None and self.parent_sentinel in events:
                logger.info("front-end process exited; engine core shutting down")
                return
            if self.stop_fd is not None and self.stop_fd in events:
                logger.info("the front end closed its link; engine core shutting down")
                return
            if self.executor_failure_fd is not None and self.executor_failure_fd in events:
                self.engine_core.model_executor.check_failed()
            changed = self._process_input_socket()
            has_work = self.engine_core.has_work()
            if self.wave.any_has_work(has_work):
                ran_forward = False
                if has_work:
                    outputs, ran_forward = self.engine_core.step()
                    self._send_outputs(outputs)
                    heap.after_work()
                self.wave.finish_step(self.engine_core, ran_forward)
            if changed and not has_work:
                # e.g. the last request was aborted: let the client see the idle state.
                self._send_outputs(EngineCoreOutputs(timestamp=time.monotonic()))

    def _process_input_socket(self) -> bool:
        """Handles every waiting message; True if requests were added or aborted."""
        changed = False
        while True:
            try:
                frame = self.input_socket.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return changed
            try:
                message = self.decoder.decode(frame.buffer)
            except msgspec.DecodeError as e:
                logger.error("dropping undecodable input message: %s", e)
                continue
            changed |= not isinstance(message, UtilityCallMessage)
            self._handle(message)

    def _handle(
        self, message: AddRequestMessage | AbortRequestsMessage | UtilityCallMessage
    ) -> None:
        if isinstance(message, AddRequestMessage):
            try:
                self.engine_core.add_request(message.request)
            except Exception as e:
                # One bad request fails alone; the engine keeps serving the others.
                logger.exception("rejecting request %s", message.request.request_id)
                failed = EngineCoreOutput(
                    request_id=message.request.request_id,
                    new_token_ids=[],
                    finish_reason=FinishReason.ERROR,
                    error=f"{type(e).__name__}: {e}",
                )
                self._send_outputs(EngineCoreOutputs(outputs=[failed], timestamp=time.monotonic()))
        elif isinstance(message, AbortRequestsMessage):
            self.engine_core.abort_requests(message.request_ids)
        else:
            self._call_utility(message)

    def _call_utility(self, message: UtilityCallMessage) -> None:
        reply = UtilityResultMessage(call_id=message.call_id)
        method = self._utilities.get(message.method)
        if method is None:
            reply.error = f"unknown engine-core utility {message.method!r}"
        else:
            try:
                reply.result = method(*message.args)
            except Exception as e:
                reply.error = f"{type(e).__name__}: {e}"
        self._send(reply)

    # --- sending ---------------------------------------------------------------------

    def _snapshot_stats(self) -> SchedulerStats:
        stats = self.engine_core.make_stats() or SchedulerStats()
        self._carried_queries += stats.prefix_cache_queries
        self._carried_hits += stats.prefix_cache_hits
        return stats

    def _send_outputs(self, outputs: EngineCoreOutputs) -> None:
        stats = outputs.scheduler_stats or self.engine_core.make_stats() or SchedulerStats()
        stats.prefix_cache_queries += self._carried_queries
        stats.prefix_cache_hits += self._carried_hits
        self._carried_queries = self._carried_hits = 0
        outputs.scheduler_stats = stats
        outputs.engine_index = self.engine_index
        outputs.kv_events = self.engine_core.in_band_kv_events.take()
        self._send(OutputsMessage(outputs))

    def _send(self, message: OutputsMessage | UtilityResultMessage | EngineErrorMessage) -> None:
        self.output_socket.send(self.encoder.encode(message), copy=False)

    def send_engine_error(self, error: str) -> None:
        try:
            self.output_socket.send(self.encoder.encode(EngineErrorMessage(error)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the client notices the exit through the process sentinel anyway

    def shutdown(self) -> None:
        self.wave.shutdown()
        self.input_socket.close(linger=0)
        # A little linger so the last outputs / error message still reach the client.
        self.output_socket.close(linger=1000)
        self.ctx.term()
        self.engine_core.shutdown()

    # --- process entry point ---------------------------------------------------------

    @staticmethod
    def run_engine_core(
        config: EngineConfig,
        input_address: str,
        output_address: str,
        ready_writer: ReadyWriter,
        log_level: int = logging.INFO,
        startup_phases: dict[str, float] | None = None,
        stop_fd: int | None = None,
    ) -> None:
        """The spawned process's life once its imports are done and it has its config
        (core_launcher._core_main). Exit code 0 on SIGTERM/SIGINT, 1 on failure.
        ``startup_phases`` (name -> seconds) are logged once logging is set up."""
        if not logging.getLogger().handlers:
            logging.basicConfig(
                level=log_level, format="%(asctime)s %(levelname)s [EngineCore] %(message)s"
            )
        for name, seconds in (startup_phases or {}).items():
            log_phase(name, seconds)
        memory_trace.start_from_env("engine_core")

        running: list[EngineCoreProc] = []

        def _on_signal(signum: int, frame: Any) -> None:
            if running and running[0].wave.lockstep:
                # Mid-step, the peers wait on this core in a collective: it stops at the
                # top of its loop instead, where a peer's next agreement sees it leave.
                running[0].stop_requested = True
                return
            raise SystemExit(0)

        if threading.current_thread() is threading.main_thread():  # not so in a Ray actor
            signal.signal(signal.SIGTERM, _on_signal)
            signal.signal(signal.SIGINT, _on_signal)
        encoder = msgspec.msgpack.Encoder()
        try:
            proc = EngineCoreProc(config, input_address, output_address, stop_fd)
        except Exception as e:
            logger.exception("engine core failed to start")
            ready_writer.send_bytes(
                encoder.encode(
                    StartupErrorMessage(type(e).__name__, str(e), traceback.format_exc())
                )
            )
            ready_writer.close()
            raise SystemExit(1) from None
        running.append(proc)
        ready_writer.send_bytes(encoder.encode(proc.ready_message()))
        ready_writer.close()
        proc.engine_core.settle_heap()
        exit_code = 0
        try:
            proc.run_busy_loop()
        except SystemExit:
            logger.info("engine core received a shutdown signal")
        except PeerCoreExitedError as e:
            # At shutdown the cores stop one after the other; a crash is reported by the
            # front end for the core that crashed.
            logger.warning("engine core stopping: %s", e)
        except Exception as e:
            logger.exception("engine core failed")
            proc.send_engine_error(f"EngineCore failed: {type(e).__name__}: {e}")
            exit_code = 1
        finally:
            proc.shutdown()
        raise SystemExit(exit_code)
