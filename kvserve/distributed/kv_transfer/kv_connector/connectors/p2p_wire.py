"""P2pZmqConnector's transport: one ZMQ message per layer, raw tensor bytes after a msgpack
header, and one acknowledgement per transfer.

Producer: a PeerSender thread per consumer address owns a DEALER socket; save_kv_layer
hands it each layer's gathered blocks as the forward computes them, so the network send
overlaps the layers that follow. A transfer is done when the consumer acknowledges all
its layers, refuses it, or send_timeout_s passes; only then does the producer free the
request's blocks.

Consumer: a Receiver thread owns a ROUTER socket bound at kv_host:kv_port and files
layers by transfer id until the decode request that claims them arrives (or buffer_ttl_s
passes). Layers arrive before or after that request; a bounded buffer (max_buffer_bytes)
refuses a transfer that does not fit rather than growing without limit.

Under tensor parallelism every rank has its own sender and receiver: a producer rank sends
only to the consumer rank with its TP rank, and each layer says which rank of which TP
size sent it; a receiver refuses a transfer sent by another rank or TP size (its KV heads
are not this rank's).

Each layer's message carries a third frame, the MAC (kvserve.kvcache.integrity) over the
transfer id and layer name, the raw header (shape, dtype, token count, prompt hash, rank)
and the bytes, computed on the sender's thread. A receiver with a KV secret refuses the
whole transfer at a layer that fails it (AUTH_FAILED): the consumer recomputes the prompt.
With the secret the sockets are CURVE too (kvserve.utils.zmq_curve): the layers cross the
network encrypted, and a sender without the secret is refused in the handshake, before
the receiver reads a byte; its transfer times out into the same failure path.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import msgspec
import torch
import zmq

from kvserve.kvcache.integrity import PLAIN, KVAuthenticator
from kvserve.utils.zmq_curve import PLAIN_SOCKETS, SocketSecurity

logger = logging.getLogger(__name__)

POLL_MS = 20
AUTH_FAILED = "a layer failed authentication (sent without this engine's KV secret)"


class LayerHeader(msgspec.Struct, tag="layer"):
    transfer_id: str
    layer_index: int
    num_layers: int
    layer_name: str
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    shape: list[int]  # [2 (K, V) or 1 (MLA), num_blocks, block_size, kv_heads, head_size]
    num_tokens: int  # prompt tokens the blocks hold
    prompt_hash: str
    tp_rank: int = 0  # the sender's: its KV heads are those of this TP rank
    tp_size: int = 1


class Ack(msgspec.Struct, tag="ack"):
    transfer_id: str
    ok: bool
    reason: str = ""


Message = LayerHeader | Ack
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous tensor (any dtype, bfloat16 included)."""
    array = tensor.contiguous().view(torch.uint8).numpy()
    return memoryview(array.data).cast("B")


def mac_key(header: LayerHeader) -> str:
    return f"{header.transfer_id}/{header.layer_name}"


def tensor_from(payload: bytes, header: LayerHeader) -> torch.Tensor:
    dtype = getattr(torch, header.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {header.dtype!r}")
    return torch.frombuffer(bytearray(payload), dtype=dtype).view(header.shape)


# ---- producer ------------------------------------------------------------------------------


@dataclass
class _Transfer:
    req_id: str
    deadline: float
    started: float
    num_bytes: int = 0


class PeerSender:
    """Sends to one consumer address from its own thread (ZMQ sockets are single-threaded)."""

    def __init__(
        self,
        context: zmq.Context,
        address: str,
        timeout_s: float,
        auth: KVAuthenticator = PLAIN,
        security: SocketSecurity = PLAIN_SOCKETS,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.auth = auth
        self._jobs: queue.Queue[tuple[str, LayerHeader, torch.Tensor]] = queue.Queue()
        self._socket = context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 0)
        security.curve_client(self._socket)
        self._socket.connect(address)
        self._transfers: dict[str, _Transfer] = {}
        self._lock = threading.Lock()
        # (req_id, ok, bytes, seconds) of finished transfers, taken by the connector.
        self._done: list[tuple[str, bool, int, float]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"kv-send-{address}", daemon=True)
        self._thread.start()

    def send_layer(self, req_id: str, header: LayerHeader, blocks: torch.Tensor) -> None:
        self._jobs.put((req_id, header, blocks))

    def take_done(self) -> list[tuple[str, bool, int, float]]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=2)

    def _finish(self, transfer_id: str, ok: bool, why: str = "") -> None:
        transfer = self._transfers.pop(transfer_id, None)
        if transfer is None:
            return
        if not ok:
            logger.warning("KV transfer %s to %s failed: %s", transfer_id, self.address, why)
        with self._lock:
            seconds = time.monotonic() - transfer.started
            self._done.append((transfer.req_id, ok, transfer.num_bytes, seconds))

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        try:
            while not self._stop:
                # Short waits while acks are due, long ones when idle.
                wait = 0.002 if self._transfers else 0.1
                try:
                    job = self._jobs.get(timeout=wait)
                except queue.Empty:
                    job = None
                while job is not None:
                    self._send(*job)
                    try:
                        job = self._jobs.get_nowait()
                    except queue.Empty:
                        job = None
                while poller.poll(0):
                    self._on_reply(self._socket.recv())
                now = time.monotonic()
                for transfer_id, transfer in list(self._transfers.items()):
                    if now > transfer.deadline:
                        self._finish(transfer_id, False, f"no answer in {self.timeout_s}s")
        finally:
            for transfer_id in list(self._transfers):
                self._finish(transfer_id, False, "the sender stopped")
            self._socket.close()

    def _send(self, req_id: str, header: LayerHeader, blocks: torch.Tensor) -> None:
        transfer = self._transfers.get(header.transfer_id)
        if transfer is None:
            now = time.monotonic()
            transfer = _Transfer(req_id, now + self.timeout_s, now)
            self._transfers[header.transfer_id] = transfer
        payload = tensor_bytes(blocks)
        raw = _encoder.encode(header)
        tag = self.auth.tag(mac_key(header), raw, payload)
        try:
            # Queued locally (no high-water mark): the send never blocks on a slow peer.
            # Again means no pipe to queue on: the peer refused the handshake for good (a
            # plaintext sender to a CURVE receiver gets an ERROR, and ZMQ stops retrying).
            self._socket.send_multipart([raw, payload, tag], zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._finish(header.transfer_id, False, "the receiver refused the connection")
            return
        except zmq.ZMQError as exc:
            self._finish(header.transfer_id, False, repr(exc))
            return
        transfer.num_bytes += payload.nbytes

    def _on_reply(self, raw: bytes) -> None:
        try:
            message = _decoder.decode(raw)
        except msgspec.DecodeError:
            logger.warning("malformed reply from %s", self.address)
            return
        if isinstance(message, Ack):
            self._finish(message.transfer_id, message.ok, message.reason)


# ---- consumer ------------------------------------------------------------------------------


@dataclass
class Arrival:
    """The layers of one transfer as they come in."""

    num_layers: int
    num_tokens: int
    prompt_hash: str
    created: float
    layers: dict[str, torch.Tensor] = field(default_factory=dict)
    num_bytes: int = 0
    first_at: float = 0.0
    last_at: float = 0.0

    @property
    def complete(self) -> bool:
        return len(self.layers) == self.num_layers


class Receiver:
    def __init__(
        self,
        bind: str,
        max_buffer_bytes: int,
        ttl_s: float,
        tp_rank: int = 0,
        tp_size: int = 1,
        auth: KVAuthenticator = PLAIN,
        security: SocketSecurity = PLAIN_SOCKETS,
    ) -> None:
        self.auth = auth
        self._security = security
        self.source = f"the P2P receiver at {bind}"
        self.auth_failures = 0  # layers refused for their MAC (read by tests and stats)
        self.max_buffer_bytes = max_buffer_bytes
        self.ttl_s = ttl_s
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        security.curve_server(self._socket)
        self._socket.bind(bind)  # fails now (address in use) rather than on a thread
        self._lock = threading.Lock()
        self._arrivals: dict[str, Arrival] = {}
        self._failed: dict[str, str] = {}  # transfer_id -> why it was refused
        self._discarded: dict[str, float] = {}  # claimed or dropped: late layers are ignored
        self._buffered = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kv-recv", daemon=True)
        self._thread.start()

    def take(self, transfer_id: str) -> Arrival | str | None:
        """The complete arrival (removed from the buffer), the reason it failed, or None
        while it is incomplete."""
        with self._lock:
            if transfer_id in self._failed:
                return self._failed.pop(transfer_id)
            arrival = self._arrivals.get(transfer_id)
            if arrival is None or not arrival.complete:
                return None
            self._drop(transfer_id)
            return arrival

    def discard(self, transfer_id: str) -> None:
        with self._lock:
            self._failed.pop(transfer_id, None)
            self._drop(transfer_id)

    @property
    def buffered_bytes(self) -> int:
        return self._buffered

    @property
    def refused_connections(self) -> int:
        """Senders refused in the CURVE handshake (another secret, or none)."""
        return self._security.refused(self._context)

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=2)
        self._socket.close()
        self._security.term(self._context)

    def _drop(self, transfer_id: str) -> None:
        arrival = self._arrivals.pop(transfer_id, None)
        if arrival is not None:
            self._buffered -= arrival.num_bytes
        self._discarded[transfer_id] = time.monotonic()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop:
            if poller.poll(POLL_MS):
                while True:
                    try:
                        frames = self._socket.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_message(frames)
            self._expire()

    def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 4:
            logger.warning("KV receiver: a message of %d frames, expected 4", len(frames))
            return
        identity, raw, payload, tag = frames
        try:
            header = _decoder.decode(raw)
            if not isinstance(header, LayerHeader):
                raise ValueError("not a layer")
            authentic = self.auth.verify(mac_key(header), raw, payload, tag, self.source)
            tensor = tensor_from(payload, header) if authentic else None
        except (msgspec.DecodeError, ValueError, RuntimeError) as exc:
            logger.warning("KV receiver: a malformed layer: %s", exc)
            return
        reply: Ack | None = None
        with self._lock:
            transfer_id = header.transfer_id
            if transfer_id in self._discarded or transfer_id in self._failed:
                return
            arrival = self._arrivals.get(transfer_id)
            if arrival is None:
                arrival = Arrival(
                    header.num_layers, header.num_tokens, header.prompt_hash, time.monotonic()
                )
                arrival.first_at = arrival.created
                self._arrivals[transfer_id] = arrival
            why = ""
            if tensor is None:
                self.auth_failures += 1
                why = AUTH_FAILED
            elif (header.tp_rank, header.tp_size) != (self.tp_rank, self.tp_size):
                why = (
                    f"sent by TP rank {header.tp_rank} of tp_size {header.tp_size} to TP rank "
                    f"{self.tp_rank} of tp_size {self.tp_size}: other KV heads"
                )
            elif self._buffered + len(payload) > self.max_buffer_bytes:
                why = f"the receive buffer ({self.max_buffer_bytes} bytes) is full"
            if why:
                self._drop(transfer_id)
                self._failed[transfer_id] = why
                reply = Ack(transfer_id, False, why)
            else:
                assert tensor is not None
                arrival.layers[header.layer_name] = tensor
                arrival.num_bytes += len(payload)
                arrival.last_at = time.monotonic()
                self._buffered += len(payload)
                if arrival.complete:
                    reply = Ack(transfer_id, True)
        if reply is not None:
            self._socket.send_multipart([identity, _encoder.encode(reply)])

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for transfer_id, arrival in list(self._arrivals.items()):
                if now - arrival.created > self.ttl_s:
                    logger.warning("KV transfer %s was never claimed: dropped", transfer_id)
                    self._drop(transfer_id)
            for transfer_id, when in list(self._discarded.items()):
                if now - when > self.ttl_s:
                    del self._discarded[transfer_id]
