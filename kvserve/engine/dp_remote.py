"""The front end's side of the engine cores it did not spawn: the ranks of ``--headless``
nodes (``--data-parallel-size-local`` below ``-dp``) and the Ray backend's actors.

DPHandshakeServer binds one ZMQ ROUTER at ``--data-parallel-address:--data-parallel-rpc-port``.
A core connects (engine_core/remote_core.py), says its rank, gets the TCP addresses its
rank's MP client bound, and sends its handshake, which the server writes to that rank's
ready pipe: from there MPClient takes it exactly as a spawned core's (RemoteCoreStartup
is a CoreStartupHandle). The connection stays open; its end (a disconnect event of the
ROUTER's monitor, for the TCP connection the core's hello came on; ZMQ heartbeats catch
a silent peer) is the core's death, signalled on a sentinel fd (RemoteCore, a
ProcessHandle), so the clients' death handling is the one a spawned core has.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvserve.protocol.dp_handshake import (
    CoreAddressesMessage,
    CoreHandshakeMessage,
    CoreHelloMessage,
    CoreShutdownMessage,
)
from kvserve.utils.processes import pipe

if TYPE_CHECKING:
    from kvserve.config import EngineConfig

logger = logging.getLogger(__name__)

HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000


class RemoteCore:
    """One remote rank, as a process handle: alive from its hello until its connection
    drops (or, for a Ray actor, its ``run`` call ends)."""

    def __init__(self, rank: int, server: DPHandshakeServer) -> None:
        self.rank = rank
        self._server = server
        self.host: str | None = None
        self._pid: int | None = None
        self._exitcode: int | None = None
        self._stopping = False
        self._dead = threading.Event()
        self._sentinel_r, self._sentinel_w = os.pipe()
        # The Ray backend kills its actor here; a headless node's core only gets asked.
        self.on_kill: Callable[[], None] = lambda: None

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def exitcode(self) -> int | None:
        return self._exitcode

    @property
    def sentinel(self) -> int:
        return self._sentinel_r

    def is_alive(self) -> bool:
        return not self._dead.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._dead.wait(timeout)

    def terminate(self) -> None:
        self._stopping = True
        self._server.send(self.rank, CoreShutdownMessage())

    def kill(self) -> None:
        self._stopping = True
        self.on_kill()
        self.mark_dead("killed")

    def on_hello(self, hello: CoreHelloMessage) -> None:
        self.host, self._pid = hello.host, hello.pid
        logger.info(
            "data-parallel rank %d connected from %s (pid %d)", self.rank, hello.host, hello.pid
        )

    def mark_dead(self, why: str) -> None:
        if self._dead.is_set():
            return
        # Unknown remotely: 0 when we asked it to stop, 1 when it went on its own.
        self._exitcode = 0 if self._stopping else 1
        if not self._stopping:
            logger.error("data-parallel rank %d (remote engine core) %s", self.rank, why)
        self._dead.set()
        os.write(self._sentinel_w, b"x")

    def close(self) -> None:
        os.close(self._sentinel_r)
        os.close(self._sentinel_w)


@dataclass
class RemoteCoreStartup:
    """A CoreStartupHandle for a remote rank: the config stays here (the core has its
    own), the client's socket addresses go out in the handshake."""

    proc: RemoteCore
    ready_reader: Connection
    ready_writer: Connection
    started: float = field(default_factory=time.perf_counter)
    transport: Literal["ipc", "tcp"] = "tcp"

    def send_config(
        self, config: EngineConfig, input_address: str, output_address: str, log_level: int
    ) -> None:
        self.proc._server.set_addresses(self.proc.rank, input_address, output_address)


class DPHandshakeServer:
    """Owns the ROUTER socket (its thread alone touches it) and the remote ranks."""

    def __init__(self, host: str, port: int, ranks: list[int]) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self.sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
        self.sock.bind(f"tcp://{host}:{port}")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        # ROUTER_NOTIFY is a draft API (absent from pyzmq's libzmq): a disconnect is
        # known by its connection's fd, which each hello's frame names (SRCFD).
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.startups: dict[int, RemoteCoreStartup] = {}
        for rank in ranks:
            reader, writer = pipe()
            self.startups[rank] = RemoteCoreStartup(RemoteCore(rank, self), reader, writer)
        self._identities: dict[int, bytes] = {}
        self._ranks: dict[bytes, int] = {}
        self._fds: dict[int, int] = {}  # connection fd -> rank
        self._addresses: dict[int, CoreAddressesMessage] = {}
        # Messages for cores, from other threads: sent by this one.
        self._outbox: list[tuple[int, CoreAddressesMessage | CoreShutdownMessage]] = []
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        self._closed = False
        self._decoder = msgspec.msgpack.Decoder(CoreHandshakeMessage)
        self._thread = threading.Thread(target=self._serve, name="DPHandshake", daemon=True)
        self._thread.start()
        logger.info(
            "data-parallel handshake server at %s, waiting for ranks %s", self.address, ranks
        )

    def set_addresses(self, rank: int, input_address: str, output_address: str) -> None:
        with self._lock:
            self._addresses[rank] = CoreAddressesMessage(input_address, output_address)
        self.send(rank, self._addresses[rank])

    def send(self, rank: int, message: CoreAddressesMessage | CoreShutdownMessage) -> None:
        with self._lock:
            self._outbox.append((rank, message))
        os.write(self._wake_w, b"x")

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self._wake_r in events:
                os.read(self._wake_r, 4096)
                if self._closed:
                    return
                self._flush_outbox()
            while self.sock.poll(0):
                identity, frame = self.sock.recv_multipart(copy=False)
                self._on_frame(identity.bytes, frame.bytes, frame.get(zmq.SRCFD))
            while self.monitor.poll(0):
                event = recv_monitor_message(self.monitor)
                rank = self._fds.pop(int(event["value"]), None)
                if rank is not None:
                    self._identities.pop(rank, None)
                    self.startups[rank].proc.mark_dead("lost its connection to the front end")

    def _flush_outbox(self) -> None:
        with self._lock:
            outbox, self._outbox = self._outbox, []
            pending = []
            for rank, message in outbox:
                identity = self._identities.get(rank)
                if identity is None:
                    # Not connected yet: its addresses go with its hello; a shutdown is moot.
                    if isinstance(message, CoreShutdownMessage):
                        self.startups[rank].proc.mark_dead("stopped before it connected")
                    continue
                pending.append((identity, message))
        for identity, message in pending:
            self.sock.send_multipart([identity, msgspec.msgpack.encode(message)])

    def _on_frame(self, identity: bytes, frame: bytes, fd: int) -> None:
        try:
            message = self._decoder.decode(frame)
        except msgspec.DecodeError as e:
            logger.error("dropping an undecodable data-parallel handshake frame: %s", e)
            return
        if isinstance(message, CoreHelloMessage):
            self._on_hello(identity, message, fd)
            return
        rank = self._ranks.get(identity)
        if rank is None:
            return
        # The core's ready (or startup error): to its client, as a spawned core's pipe.
        writer = self.startups[rank].ready_writer
        writer.send_bytes(frame)
        writer.close()
        logger.debug("data-parallel rank %d handshake: %s", rank, type(message).__name__)

    def _on_hello(self, identity: bytes, hello: CoreHelloMessage, fd: int) -> None:
        startup = self.startups.get(hello.rank)
        if startup is None or hello.rank in self._identities:
            why = "not a remote rank here" if startup is None else "already connected"
            logger.error("refusing data-parallel rank %d from %s: %s", hello.rank, hello.host, why)
            self.sock.send_multipart([identity, msgspec.msgpack.encode(CoreShutdownMessage())])
            return
        with self._lock:
            self._identities[hello.rank] = identity
            addresses = self._addresses.get(hello.rank)
        self._ranks[identity] = hello.rank
        self._fds[fd] = hello.rank
        startup.proc.on_hello(hello)
        if addresses is not None:
            self.sock.send_multipart([identity, msgspec.msgpack.encode(addresses)])

    def close(self) -> None:
        """After the clients stopped their cores."""
        if self._closed:
            return
        self._closed = True
        os.write(self._wake_w, b"x")
        self._thread.join(5)
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
        self.ctx.term()
        for startup in self.startups.values():
            startup.ready_reader.close()
            startup.ready_writer.close()
            startup.proc.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
