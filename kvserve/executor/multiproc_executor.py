"""MultiprocExecutor: one worker process per rank on this machine, reached over ZMQ.

Each call is one msgpack frame (serial_utils.RPCRequest) pushed to every worker on its
own socket; replies come back on one shared socket. A background thread reads the
replies and watches every worker's process sentinel in the same poll: when a worker
exits on its own, every pending and later call fails with ExecutorFailedError naming
the rank and exit code, and the surviving workers (blocked in a collective with the dead
one) are killed, so the engine never waits on a rank that will not answer.

A step is two calls: ``execute_model`` (no reply awaited) then ``sample_tokens``, whose
reply comes from the output rank alone (the first rank of the last pipeline stage, which
samples); an error on any rank fails the step. Each worker serves its calls in order, so
with pipeline parallelism the engine core may send the next micro-batch's calls before
the last stage has answered (``max_concurrent_batches``): the first stage, done with its
layers, starts on them while the last stage still runs the previous batch.
"""

from __future__ import annotations

import itertools
import logging
import os
import tempfile
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Literal, overload

import msgspec
import zmq

from kvserve.executor import serial_utils as wire
from kvserve.executor.abstract import Executor, ExecutorFailedError
from kvserve.executor.multiproc_worker import run_worker
from kvserve.protocol.kv_cache_interface import KVCacheConfig, KVCacheSpec
from kvserve.protocol.runner_output import ModelRunnerOutput
from kvserve.protocol.scheduler_output import GrammarOutput, SchedulerOutput
from kvserve.utils.processes import (
    ChildResources,
    free_port,
    pipe,
    spawn,
    startup_error,
    stop,
    wait_for_handshake,
)
from kvserve.utils.threads import usable_cores

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = float(os.environ.get("KVSERVE_WORKER_STARTUP_TIMEOUT", "600"))


@dataclass
class _Call:
    future: Future[list[Any]]
    expected: set[int]
    return_type: Any
    method: str
    results: dict[int, Any] = field(default_factory=dict)


class MultiprocExecutor(Executor):
    def _init_executor(self) -> None:
        self.world_size = self.config.parallel_config.world_size
        self._init_call_state()
        self._wake_r, wake_w = os.pipe()
        self.resources = ChildResources(
            zmq.Context(),
            tmpdir=tempfile.mkdtemp(prefix="kvserve-mp-"),
            fds=[self._wake_r, wake_w, *self._failure_pipe],
            wake_fd=wake_w,
            exit_grace_s=2.0,  # shutdown() has told them to exit
        )
        self._finalizer = weakref.finalize(self, self.resources)
        try:
            self._start_workers()
        except BaseException:
            self._finalizer()
            raise

    def _init_call_state(self) -> None:
        self.failure: str | None = None
        self._call_ids = itertools.count()
        self._pending: dict[int, _Call] = {}
        self._lock = threading.Lock()
        self._step_future: Future[list[Any]] | None = None
        self._reply_decoder = msgspec.msgpack.Decoder(wire.RPCReply)
        # Readable once a worker is lost: failure_fd(), for the engine core's poller.
        self._failure_pipe = os.pipe()

    def _start_workers(self) -> None:
        res = self.resources
        self.reply_socket = res.ctx.socket(zmq.PULL)
        reply_address = f"ipc://{res.tmpdir}/reply.sock"
        self.reply_socket.bind(reply_address)
        res.sockets.append(self.reply_socket)
        self.request_sockets: list[zmq.Socket[Any]] = []
        init_method = f"tcp://127.0.0.1:{free_port()}"
        # This core's share of the cores (data parallelism: several cores share them).
        share = usable_cores() // self.config.parallel_config.data_parallel_size
        threads = max(1, share // self.world_size)
        readers = []
        procs: list[BaseProcess] = []
        log_level = logging.getLogger("kvserve").getEffectiveLevel()
        for rank in range(self.world_size):
            sock = res.ctx.socket(zmq.PUSH)
            address = f"ipc://{res.tmpdir}/request{rank}.sock"
            sock.bind(address)
            res.sockets.append(sock)
            self.request_sockets.append(sock)
            reader, writer = pipe()
            # The config travels by spawn (our own child); every later message is msgpack.
            args = (self.config, rank, init_method, address, reply_address, writer, threads)
            proc = spawn(run_worker, (*args, log_level), f"Worker{rank}", num_threads=threads)
            writer.close()
            res.procs.append(proc)
            procs.append(proc)
            readers.append(reader)
        for rank, reader in enumerate(readers):
            self._wait_ready(rank, reader, procs[rank])
        logger.info(
            "MultiprocExecutor: %d workers ready (%d threads each), pids %s",
            self.world_size, threads, [p.pid for p in res.procs],
        )  # fmt: skip
        res.thread = threading.Thread(target=self._reply_loop, name="WorkerReplies", daemon=True)
        res.thread.start()

    def _wait_ready(self, rank: int, reader: Connection, proc: BaseProcess) -> None:
        data = wait_for_handshake(reader, proc, STARTUP_TIMEOUT_S, f"worker {rank}")
        ready = wire.decode(data, wire.ReadyMessage)
        if ready.error is not None:
            raise startup_error(ready.error_type, f"worker {rank}: {ready.error}")

    # ---- replies and worker health (background thread) ---------------------------------

    def _reply_loop(self) -> None:
        try:
            self._poll_replies()
        except Exception as e:  # never leave callers waiting on a thread that is gone
            logger.exception("MultiprocExecutor: the reply thread failed")
            self._fail(f"the executor's reply thread failed: {type(e).__name__}: {e}")

    def _poll_replies(self) -> None:
        res = self.resources
        poller = zmq.Poller()
        poller.register(self.reply_socket, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(res.procs)}
        for fd in sentinels:
            poller.register(fd, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self._wake_r in events:
                return
            if self.reply_socket in events:
                while True:
                    try:
                        frame = self.reply_socket.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._on_reply(self._reply_decoder.decode(frame.buffer))
            dead = [rank for fd, rank in sentinels.items() if fd in events]
            if dead and not res.closed:
                proc = res.procs[dead[0]]
                proc.join(1)
                self._fail(f"worker {dead[0]} (pid {proc.pid}) died with exit code {proc.exitcode}")
                return

    def _on_reply(self, reply: wire.RPCReply) -> None:
        with self._lock:
            call = self._pending.get(reply.call_id)
            if call is None:
                return  # timed out already
            if reply.error is not None:
                del self._pending[reply.call_id]
                error: Exception = RuntimeError(
                    f"worker {reply.rank}: {call.method} failed: {reply.error}"
                )
                call.future.set_exception(error)
                return
            if reply.has_result:
                try:
                    call.results[reply.rank] = wire.decode(reply.result, call.return_type)
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    del self._pending[reply.call_id]
                    call.future.set_exception(e)
                    return
            if call.expected <= call.results.keys():
                del self._pending[reply.call_id]
                call.future.set_result([call.results[r] for r in sorted(call.expected)])

    def _fail(self, message: str) -> None:
        logger.error("%s: %s; stopping the other workers", type(self).__name__, message)
        self.failure = message
        os.write(self._failure_pipe[1], b"x")
        with self._lock:
            pending, self._pending = self._pending, {}
        for call in pending.values():
            call.future.set_exception(ExecutorFailedError(message))
        # The survivors are blocked in a collective with the dead rank: nothing to save.
        self._kill_workers()

    def _kill_workers(self) -> None:
        stop(self.resources.procs)

    def _send(self, frame: bytes) -> None:
        for sock in self.request_sockets:
            sock.send(frame, copy=False)

    # ---- calls ---------------------------------------------------------------------------

    def _method_name(self, method: str | Callable[..., Any]) -> str:
        if isinstance(method, str):
            return method
        qualname = getattr(method, "__qualname__", "")
        if "<" in qualname or not getattr(method, "__module__", None):
            raise ValueError(
                f"{method!r} cannot be called in a worker process: pass an importable "
                "module-level function, or its 'module:function' path"
            )
        return f"{method.__module__}:{qualname}"

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        if self.failure is not None:
            raise ExecutorFailedError(self.failure)
        if self._is_closed():
            raise ExecutorFailedError("the executor has been shut down")
        name = self._method_name(method)
        return_type = wire.rpc_return_type(wire.rpc_target(name))
        kwargs = kwargs or {}
        call_id = next(self._call_ids)
        request = wire.RPCRequest(
            call_id,
            name,
            [msgspec.Raw(wire.encode(a)) for a in args],
            {k: msgspec.Raw(wire.encode(v)) for k, v in kwargs.items()},
            unique_reply_rank,
        )
        frame = wire.encode(request)
        expected = set(range(self.world_size)) if unique_reply_rank is None else {unique_reply_rank}
        future: Future[list[Any]] = Future()
        with self._lock:
            self._pending[call_id] = _Call(future, expected, return_type, name)
        self._send(frame)
        if non_block:
            return future
        return self._result(future, call_id, name, timeout)

    def _result(
        self, future: Future[list[Any]], call_id: int, name: str, timeout: float | None
    ) -> list[Any]:
        try:
            return future.result(timeout)
        except FutureTimeout:
            with self._lock:
                self._pending.pop(call_id, None)
            raise TimeoutError(f"collective_rpc {name!r}: no answer within {timeout} s") from None

    # ---- KV cache set-up: specs travel with their attention type ---------------------

    def get_kv_cache_specs(self) -> list[dict[str, KVCacheSpec]]:
        per_rank = self.collective_rpc(wire.kv_cache_spec_frames)
        return [{n: wire.spec_from_frame(f) for n, f in specs.items()} for specs in per_rank]

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.collective_rpc(
            wire.initialize_from_config_frame, args=(wire.KVCacheConfigFrame.of(kv_cache_config),)
        )

    # ---- a step: the forward on every rank, the sampled tokens from the output rank ----

    @property
    def output_rank(self) -> int:
        """Rank 0 of the last pipeline stage's TP group: it samples and replies."""
        parallel = self.config.parallel_config
        return (parallel.pipeline_parallel_size - 1) * parallel.tensor_parallel_size

    @property
    def max_concurrent_batches(self) -> int:
        parallel = self.config.parallel_config
        return parallel.pipeline_parallel_size if parallel.batch_queue else 1

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> Future[Any] | None:
        future: Future[list[Any]] = self.collective_rpc(
            "execute_model",
            args=(scheduler_output,),
            non_block=True,
            unique_reply_rank=self.output_rank,
        )
        self._step_future = future  # sample_tokens' result waits on it
        return future if non_block else None

    @overload
    def sample_tokens(
        self, grammar_output: GrammarOutput | None = None, non_block: Literal[False] = False
    ) -> ModelRunnerOutput: ...
    @overload
    def sample_tokens(
        self, grammar_output: GrammarOutput | None, non_block: Literal[True]
    ) -> Future[ModelRunnerOutput]: ...
    def sample_tokens(
        self, grammar_output: GrammarOutput | None = None, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        sample: Future[list[Any]] = self.collective_rpc(
            "sample_tokens",
            args=(grammar_output,),
            non_block=True,
            unique_reply_rank=self.output_rank,
        )
        step, self._step_future = self._step_future, None
        result = _step_result(step, sample)
        return result if non_block else result.result()

    def _is_closed(self) -> bool:
        return self.resources.closed

    def failure_fd(self) -> int | None:
        return self._failure_pipe[0]

    def check_failed(self) -> None:
        if self.failure is not None:
            raise ExecutorFailedError(self.failure)

    def check_health(self) -> None:
        self.check_failed()
        super().check_health()

    def shutdown(self) -> None:
        res = self.resources
        if res.closed:
            return
        if self.failure is None:
            frame = wire.encode(wire.RPCShutdown())
            for sock in self.request_sockets:
                sock.send(frame)
        self._finalizer()


def _step_result(
    step: Future[list[Any]] | None, sample: Future[list[Any]]
) -> Future[ModelRunnerOutput]:
    """The step's output, or the first error of its two calls: a rank whose forward
    failed fails the step at once, while later stages may still wait for its tensors."""
    result: Future[ModelRunnerOutput] = Future()

    def settle(done: Future[list[Any]]) -> None:
        error = done.exception()
        if error is None and done is step:
            return  # the forward went through: the sampled tokens will follow
        output = done.result()[0] if error is None else None
        if error is None and not isinstance(output, ModelRunnerOutput):
            error = TypeError(f"sample_tokens returned {type(output).__name__}")
        try:
            if error is not None:
                result.set_exception(error)
            else:
                result.set_result(output)  # type: ignore[arg-type]
        except InvalidStateError:
            pass  # settled by the other call already

    if step is not None:
        step.add_done_callback(settle)
    sample.add_done_callback(settle)
    return result
