"""The process of one worker rank under MultiprocExecutor.

It joins the torch.distributed group (the worker's init_device does), loads its shard of
the model, reports ready through a pipe, then serves RPCs: each arrives on its own ZMQ
PULL socket as an ``RPCRequest`` and its reply goes back on a shared PUSH socket. Both
are msgpack (serial_utils); the only pickle is multiprocessing's spawn of this function
with the config, parent to its own child, as the engine core process itself is started.
"""

from __future__ import annotations

import logging
import os
import signal
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from kvserve.config import EngineConfig
from kvserve.executor import serial_utils as wire
from kvserve.utils import memory_trace
from kvserve.utils.heap_trim import HeapTrimmer
from kvserve.worker.worker import Worker

logger = logging.getLogger(__name__)

PARENT_CHECK_MS = 1000


def _call(worker: Worker, request: wire.RPCRequest) -> Any:
    fn = wire.rpc_target(request.method, worker)
    arg_types, kwarg_types = wire.rpc_arg_types(fn, len(request.args), list(request.kwargs))
    args = [wire.decode(raw, t) for raw, t in zip(request.args, arg_types, strict=True)]
    kwargs = {k: wire.decode(raw, kwarg_types[k]) for k, raw in request.kwargs.items()}
    return fn(worker, *args, **kwargs)


def call_worker(worker: Worker, rank: int, request: wire.RPCRequest) -> wire.RPCReply:
    """Runs one call; its reply (with the result only where this rank is asked for it,
    with the error from any rank)."""
    reply = wire.RPCReply(request.call_id, rank)
    try:
        result = _call(worker, request)
        if request.reply_rank is None or request.reply_rank == rank:
            reply.result = msgspec.Raw(wire.encode(result))
            reply.has_result = True
    except Exception as e:
        logger.exception("worker %d: %s failed", rank, request.method)
        reply.error = f"{type(e).__name__}: {e}"
    return reply


def serve(worker: Worker, rank: int, request_socket: Any, reply_socket: Any) -> None:
    decoder = msgspec.msgpack.Decoder(wire.WorkerInput)
    parent = os.getppid()
    heap = HeapTrimmer()
    while True:
        # Wake up now and then to notice a parent killed without a goodbye (SIGKILL).
        if not request_socket.poll(PARENT_CHECK_MS):
            heap.before_idle()
            if os.getppid() != parent:
                logger.error("worker %d: the engine process is gone; exiting", rank)
                return
            continue
        message = decoder.decode(request_socket.recv(copy=False).buffer)
        if isinstance(message, wire.RPCShutdown):
            return
        reply = call_worker(worker, rank, message)
        # Ranks not asked stay silent unless they failed (a step costs one reply).
        if reply.has_result or reply.error is not None or message.reply_rank is None:
            reply_socket.send(wire.encode(reply))
        heap.after_work()


def run_worker(
    config: EngineConfig,
    rank: int,
    distributed_init_method: str,
    request_address: str,
    reply_address: str,
    ready_writer: Connection,
    num_threads: int,
    log_level: int,
) -> None:
    """Target of the spawned worker process; exits 0 when told to shut down."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=log_level, format=f"%(asctime)s %(levelname)s [Worker{rank}] %(message)s"
        )
    # The engine core owns shutdown: its SIGTERM ends the worker, Ctrl-C goes to it alone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    memory_trace.start_from_env(f"worker_{rank}")
    import torch

    torch.set_num_threads(num_threads)  # this rank's share of the cores
    ctx = zmq.Context()
    request_socket = ctx.socket(zmq.PULL)
    request_socket.connect(request_address)
    reply_socket = ctx.socket(zmq.PUSH)
    reply_socket.connect(reply_address)
    worker = Worker(config, rank, rank, distributed_init_method)
    try:
        worker.init_device()
        worker.load_model()
    except Exception as e:
        logger.exception("worker %d failed to start", rank)
        ready_writer.send_bytes(wire.encode(wire.ReadyMessage(rank, type(e).__name__, str(e))))
        raise SystemExit(1) from None
    ready_writer.send_bytes(wire.encode(wire.ReadyMessage(rank)))
    ready_writer.close()
    try:
        serve(worker, rank, request_socket, reply_socket)
    finally:
        worker.shutdown()
        request_socket.close(linger=0)
        reply_socket.close(linger=1000)
        ctx.term()
