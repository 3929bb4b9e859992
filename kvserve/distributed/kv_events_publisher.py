"""Publishing KV cache events over ZMQ, the way vLLM's KV event publishers do.

Wire format of the PUB socket, one multipart message per KVEventBatch:

    [topic (utf-8), sequence number (8 bytes, big-endian), msgpack(KVEventBatch)]

Block hashes travel as msgpack bin: the engine's 32-byte BlockHash digests, exactly the
bytes in ``Request.block_hashes`` (see kvserve.core.kv_cache_utils), so a subscriber that
hashes the same tokens with the same ``prefix_caching_hash_seed`` matches them directly.
vLLM may publish ints instead; kvserve always publishes bytes.

Sequence numbers start at 0 and grow by one per published batch. They are taken in
publish(), so a batch dropped because the queue was full leaves a visible gap.

Replay (optional ROUTER socket): a client (DEALER) sends ``[b"", start_seq (8 bytes)]``;
the publisher answers ``[b"", seq, payload]`` for every buffered batch with seq >=
start_seq, then ``[b"", END_SEQ, b""]`` where END_SEQ is -1 as 8 signed big-endian bytes.

Nothing is pickled: payloads are msgspec msgpack. With a KV secret both sockets are CURVE
servers (kvserve.utils.zmq_curve): events carry the prompts' token ids, and a subscriber
without the secret is refused (and logged) before it receives any.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections import deque
from typing import TYPE_CHECKING

import msgspec
import zmq

from kvserve.protocol.kv_events import KVEvent, KVEventBatch
from kvserve.utils.kv_secret import read_kv_secret
from kvserve.utils.zmq_curve import PLAIN_SOCKETS, SocketSecurity, socket_security

if TYPE_CHECKING:
    # Typing only: kvserve.config pulls in transformers, too slow for `kvserve events`.
    from kvserve.config import KVEventsConfig

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(data: bytes) -> int:
    return int.from_bytes(data, "big", signed=True)


class EventPublisher(ABC):
    """Takes the engine's KVEventBatches; publish() must never block the engine step."""

    @abstractmethod
    def publish(self, events: KVEventBatch) -> None: ...

    @abstractmethod
    def shutdown(self) -> None:
        """Delivers what is queued (best effort), then releases sockets and threads."""


class NullEventPublisher(EventPublisher):
    """Events disabled: every batch is dropped."""

    def publish(self, events: KVEventBatch) -> None:
        return None

    def shutdown(self) -> None:
        return None


class ZmqEventPublisher(EventPublisher):
    """PUB socket (+ optional replay ROUTER) owned by one background thread.

    publish() (from the engine thread only) takes a sequence number and appends to a
    bounded queue, nothing more; the thread encodes, sends, keeps the last
    ``buffer_steps`` payloads for replay and answers replay requests between sends.
    Binding happens in the thread too (ZMQ sockets belong to one thread), and the
    constructor waits for it so a busy port fails here.
    """

    _POLL_S = 0.01

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
        security: SocketSecurity = PLAIN_SOCKETS,
    ) -> None:
        self._topic = topic.encode()
        self._security = security
        self._hwm = hwm
        self._queue: queue.Queue[tuple[int, KVEventBatch]] = queue.Queue(max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = itertools.count()
        self._stop = threading.Event()
        self._closed = False
        self.num_dropped = 0
        self._ctx = zmq.Context()
        # Filled in by the thread once bound: the real addresses (a "*" port resolved).
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(endpoint, replay_endpoint), name="kv-events", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            self._security.term(self._ctx)
            raise RuntimeError(f"KV events publisher cannot bind: {self._error}") from self._error

    # --- engine thread ----------------------------------------------------------

    def publish(self, events: KVEventBatch) -> None:
        if self._closed:
            raise RuntimeError("publish() on a closed ZmqEventPublisher")
        seq = next(self._seq)
        try:
            self._queue.put_nowait((seq, events))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                logger.warning(
                    "KV events queue full: dropped %d batches (seq %d)", self.num_dropped, seq
                )

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("KV events publisher thread did not stop within %.1fs", timeout)
        else:
            self._security.term(self._ctx)

    # --- publisher thread -------------------------------------------------------

    def _run(self, endpoint: str, replay_endpoint: str | None) -> None:
        pub = replay = None
        try:
            pub = self._ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self._hwm)
            self._security.curve_server(pub)
            pub.bind(endpoint)
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if replay_endpoint is not None:
                replay = self._ctx.socket(zmq.ROUTER)
                # ROUTER silently drops past its HWM: a replay of the whole buffer must fit.
                replay.setsockopt(zmq.SNDHWM, 0)
                self._security.curve_server(replay)
                replay.bind(replay_endpoint)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._error = exc
            for sock in (pub, replay):
                if sock is not None:
                    sock.close(linger=0)
            self._ready.set()
            return
        self._ready.set()
        encoder = msgspec.msgpack.Encoder()
        try:
            # After stop, keep draining: what was published before shutdown still goes out.
            while True:
                try:
                    seq, batch = self._queue.get(timeout=self._POLL_S)
                except queue.Empty:
                    if self._stop.is_set():
                        break
                else:
                    payload = encoder.encode(batch)
                    pub.send_multipart((self._topic, encode_seq(seq), payload))
                    self._buffer.append((seq, payload))
                if replay is not None:
                    self._serve_replays(replay)
        except Exception:
            logger.exception("KV events publisher thread failed")
        finally:
            # A short linger lets queued messages reach connected subscribers.
            pub.close(linger=1000)
            if replay is not None:
                replay.close(linger=1000)

    def _serve_replays(self, replay: zmq.Socket[bytes]) -> None:
        while replay.poll(0):
            frames = replay.recv_multipart()
            # [identity, b"", start] from a DEALER/REQ client; [identity, start] is accepted too.
            identity, envelope, start = frames[0], frames[1:-1], frames[-1]
            if len(start) != 8 or len(frames) not in (2, 3):
                logger.warning("ignoring a malformed KV events replay request: %r", frames)
                continue
            start_seq = decode_seq(start)
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    replay.send_multipart((identity, *envelope, encode_seq(seq), payload))
            replay.send_multipart((identity, *envelope, END_SEQ, b""))


def offset_port(endpoint: str, offset: int) -> str:
    """tcp://host:5557 -> tcp://host:(5557 + offset), so data-parallel ranks do not clash."""
    if offset == 0 or not endpoint.startswith("tcp://"):
        return endpoint
    head, _, port = endpoint.rpartition(":")
    if not port.isdigit():  # "*": each rank binds its own free port anyway
        return endpoint
    return f"{head}:{int(port) + offset}"


class InBandEventPublisher(EventPublisher):
    """Keeps the events for the core's own outputs (EngineCoreOutputs.kv_events), which
    carry them to a data-parallel front end's prefix index; disabled, it keeps nothing."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._events: list[KVEvent] = []

    def publish(self, events: KVEventBatch) -> None:
        if self.enabled:
            self._events.extend(events.events)

    def take(self) -> list[KVEvent] | None:
        """The events since the last take (None: none)."""
        if not self._events:
            return None
        events, self._events = self._events, []
        return events

    def shutdown(self) -> None:
        self._events = []


class EventPublisherFactory:
    """Builds the publisher that KVEventsConfig names ("null" or "zmq")."""

    @staticmethod
    def create(
        config: KVEventsConfig | None,
        data_parallel_rank: int = 0,
        kv_secret_file: str | None = None,
    ) -> EventPublisher:
        """kv_secret_file: the engine's --kv-secret-file (None: KVSERVE_KV_SECRET, if set)."""
        if config is None or not config.enable_kv_cache_events or config.publisher == "null":
            return NullEventPublisher()
        if config.publisher != "zmq":
            raise ValueError(f"unknown KV event publisher {config.publisher!r}")
        replay = config.replay_endpoint
        return ZmqEventPublisher(
            endpoint=offset_port(config.endpoint, data_parallel_rank),
            replay_endpoint=None if replay is None else offset_port(replay, data_parallel_rank),
            buffer_steps=config.buffer_steps,
            hwm=config.hwm,
            max_queue_size=config.max_queue_size,
            topic=config.topic,
            security=socket_security(read_kv_secret(kv_secret_file)),
        )
