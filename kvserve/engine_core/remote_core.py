"""An engine core the front end did not spawn: one on a ``--headless`` node (a process
that node's launcher spawned, engine/headless.py) or in a Ray actor (engine/dp_ray.py).

It reaches the front end's DP handshake server (engine/dp_remote.py) over one ZMQ
DEALER connection (protocol/dp_handshake.py): says its rank, gets the addresses of its
two sockets there, loads its model and answers with its handshake; from then on it is
an EngineCoreProc like a spawned one, on TCP instead of IPC. The link stays open: when
it drops (the front end exited or its machine vanished: ZMQ heartbeats notice a silent
peer) or the front end sends CoreShutdownMessage, a watcher thread wakes the busy loop
through a pipe and the core shuts down cleanly.

Light at import: torch comes with EngineCoreProc, imported when the core runs, so a
headless launcher can import this module without loading the model stack.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvserve.protocol.dp_handshake import (
    CoreHelloMessage,
    CoreShutdownMessage,
    FrontEndHandshakeMessage,
)

if TYPE_CHECKING:
    from kvserve.config import EngineConfig

logger = logging.getLogger(__name__)

# A silent peer (its machine gone, no FIN) is noticed after this long without a heartbeat.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000


def set_heartbeats(sock: zmq.Socket[Any]) -> None:
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


class FrontEndLink:
    """The core's end of its handshake connection: carries its handshake (the
    ReadyWriter EngineCoreProc writes to), then watches for the front end's end."""

    def __init__(self, handshake_address: str, rank: int) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        set_heartbeats(self.sock)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.connect(handshake_address)
        self.rank = rank
        # Readable once the core must stop (EngineCoreProc polls it).
        self.stop_r, self._stop_w = os.pipe()
        # Wakes the watcher for its exit before the sockets close.
        self._wake_r, self._wake_w = os.pipe()
        self._thread: threading.Thread | None = None
        self._decoder = msgspec.msgpack.Decoder(FrontEndHandshakeMessage)

    def hello(self) -> tuple[str, str] | None:
        """Says who this core is; the front end's input and output addresses for it (it
        may not be up yet: ZMQ connects when it is), or None if told to stop first."""
        host = socket.gethostname()
        self.sock.send(msgspec.msgpack.encode(CoreHelloMessage(self.rank, host, os.getpid())))
        logger.info("data-parallel rank %d waiting for its front end", self.rank)
        message = self._decoder.decode(self.sock.recv())
        if isinstance(message, CoreShutdownMessage):
            return None
        return message.input_address, message.output_address

    # ReadyWriter: the handshake, then the watch starts.
    def send_bytes(self, buf: bytes) -> None:
        self.sock.send(buf)

    def close(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="FrontEndLink", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self._wake_r in events:
                return
            if self.monitor in events:
                event = recv_monitor_message(self.monitor)
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    logger.info("data-parallel rank %d lost its front end", self.rank)
                    break
            if self.sock in events:
                message = self._decoder.decode(self.sock.recv())
                if isinstance(message, CoreShutdownMessage):
                    break
        os.write(self._stop_w, b"x")

    def shutdown(self) -> None:
        """After the core's loop ended: closes the link (the front end sees it drop)."""
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(2)
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=1000)  # a startup error still reaches the front end
        self.ctx.term()
        for fd in (self.stop_r, self._stop_w, self._wake_r, self._wake_w):
            os.close(fd)


def run_remote_engine_core(config: EngineConfig, handshake_address: str, log_level: int) -> int:
    """The core's life: handshake, serve, shut down; its exit code (0: stopped)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=log_level, format="%(asctime)s %(levelname)s [EngineCore] %(message)s"
        )
    link = FrontEndLink(handshake_address, config.parallel_config.data_parallel_rank)
    try:
        addresses = link.hello()
        if addresses is None:
            return 0
        from kvserve.engine_core.core_proc import EngineCoreProc

        try:
            EngineCoreProc.run_engine_core(config, *addresses, link, log_level, stop_fd=link.stop_r)
        except SystemExit as e:
            return int(e.code or 0)
        return 0
    finally:
        link.shutdown()


def headless_core_main(config: EngineConfig, handshake_address: str, log_level: int) -> None:
    """The process a headless node's launcher spawns for one rank."""
    raise SystemExit(run_remote_engine_core(config, handshake_address, log_level))


class RayEngineCoreActor:
    """The body of one data-parallel rank's Ray actor (wrapped by ray.remote in
    engine/dp_ray.py). Its ``run`` call lasts the core's life; the config reaches the
    actor once, as a spawned core's reaches it, and everything after travels over ZMQ."""

    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def run(self, config: EngineConfig, handshake_address: str, log_level: int) -> int:
        return run_remote_engine_core(config, handshake_address, log_level)
