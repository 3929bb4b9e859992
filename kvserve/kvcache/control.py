"""The tier's control service: a cache controller's pin / unpin / clear / move reach one
engine's CacheEngine here, over ZMQ.

A controller (kvserve.entrypoints.cache_controller) holds one ControlClient per registered
instance and sends typed msgspec requests (never pickle); the ControlServer in the
instance's worker answers each against its CacheEngine. ``move`` is an export from one
instance's tier and an import into another's: the chunks travel as raw serde bytes
sealed with the KV secret's MAC (kvcache.integrity), so the importing instance stores only
chunks that a holder of the same secret wrote, and nothing on the way can change them.

Wire: one multipart message per request and per reply, [msgpack header, *chunk frames]:
the header is one of the typed structs below and names each chunk (WireChunk); chunk i's
sealed bytes are frame i after it, sent and received without copies.

Over TCP the sockets are CURVE when a KV secret is set (kvserve.utils.zmq_curve): a
client without it is refused and its requests time out. The service answers one
request at a time in a daemon thread; a failure is an answer with ``error`` set.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import msgspec
import zmq

from kvserve.kvcache import serde
from kvserve.kvcache.key import CacheEngineKey
from kvserve.utils.zmq_curve import PLAIN_SOCKETS, SocketSecurity
from kvserve.utils.zmq_service import RouterService

if TYPE_CHECKING:
    from kvserve.kvcache.cache_engine import CacheEngine

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 30.0


class InfoRequest(msgspec.Struct, tag="info"):
    seq: int


class PinRequest(msgspec.Struct, tag="pin"):
    seq: int
    tokens: list[int]
    medium: str
    tags: list[tuple[str, str]] = []
    unpin: bool = False


class InventoryRequest(msgspec.Struct, tag="inventory"):
    """Every chunk hash each tier holds (those that can list them): a controller that
    registers late, or lost events, starts from this and follows the events after it."""

    seq: int


class ClearRequest(msgspec.Struct, tag="clear"):
    seq: int
    medium: str


class ExportRequest(msgspec.Struct, tag="export"):
    seq: int
    tokens: list[int]
    medium: str
    tags: list[tuple[str, str]] = []


class WireChunk(msgspec.Struct):
    """One chunk of KV: its key string and serde metadata; its sealed (MAC'd) bytes are
    the frame that goes with it."""

    key: str
    start: int
    end: int
    shape: list[int]
    dtype: str
    serde: str


# A chunk in hand: its header and its sealed bytes.
Chunk = tuple[WireChunk, serde.Buffer]


class ImportRequest(msgspec.Struct, tag="import"):
    seq: int
    medium: str
    chunks: list[WireChunk]


class TierInfo(msgspec.Struct):
    """What a controller needs to hash prompts as this engine's tier does."""

    model_name: str
    chunk_size: int
    hash_seed: int
    save_unfull_chunk: bool
    media: list[str]


class ControlReply(msgspec.Struct):
    seq: int
    # pin/unpin: prefix tokens acted on; import: tokens of the chunks stored.
    tokens: int = 0
    info: TierInfo | None = None
    chunks: list[WireChunk] = []  # export: one frame each follows the header
    # import: chunks refused (MAC failed, another model's key, does not decode).
    rejected: int = 0
    # inventory: tier -> the chunk hashes it holds (32 bytes each)
    inventory: dict[str, list[bytes]] = {}
    error: str | None = None


ControlRequest = (
    InfoRequest | InventoryRequest | PinRequest | ClearRequest | ExportRequest | ImportRequest
)
Tags = tuple[tuple[str, str], ...]


def export_chunks(engine: CacheEngine, tokens: list[int], medium: str, tags: Tags) -> list[Chunk]:
    """The chunks of the prefix of tokens that tier ``medium`` holds, in order, sealed."""
    backend = engine.storage.by_medium(medium)
    out: list[Chunk] = []
    for chunk in engine.chunks(tokens, tags):
        kv = backend.get(chunk.key)  # the named tier only: no promotion into the CPU tier
        if kv is None:
            break
        name = chunk.key.to_string()
        meta, payload = serde.encode(kv, "raw")
        header = WireChunk(name, chunk.start, chunk.end, list(meta.shape), meta.dtype, meta.serde)
        out.append((header, serde.seal_chunk(engine.auth, name, meta, payload)))
    return out


def import_chunks(engine: CacheEngine, chunks: list[Chunk], medium: str) -> tuple[int, int]:
    """Stores the chunks that are this engine's (model, shard, dtype) and pass the MAC into
    tier ``medium``; returns (tokens of the leading run the tier now holds, chunks refused).
    """
    backend = engine.storage.by_medium(medium)
    mine = engine.metadata
    rejected = 0
    # (key, end) per chunk in order; None where refused: the leading run stops there.
    accepted: list[tuple[CacheEngineKey | None, int]] = []
    for chunk, blob in chunks:
        try:
            key = CacheEngineKey.from_string(chunk.key)
            if (key.model_name, key.world_size, key.worker_id, key.dtype) != (
                mine.model_name, mine.world_size, mine.worker_id, mine.kv_dtype
            ):  # fmt: skip
                raise ValueError(f"chunk {chunk.key} belongs to another model or shard")
            meta = serde.ChunkMeta.from_dict(
                {"shape": chunk.shape, "dtype": chunk.dtype, "serde": chunk.serde}
            )
            payload = serde.open_chunk(engine.auth, chunk.key, meta, blob, "a moved chunk")
            if payload is None:
                raise ValueError(f"chunk {chunk.key} failed its MAC")
            kv = serde.decode(meta, payload).clone()  # owned: the tier keeps a reference
        except ValueError as exc:
            logger.warning("KV import: %s; refused", exc)
            rejected += 1
            accepted.append((None, chunk.end))
            continue
        backend.put(key, kv)
        accepted.append((key, chunk.end))
    backend.flush(timeout=30)  # a disk import is on disk when the answer comes
    # A full tier may have dropped some (its pinned chunks are not evicted for them).
    stored = 0
    for held, end in accepted:
        if held is None or not backend.contains(held):
            break
        stored = end
    return stored, rejected


class ControlServer:
    """Answers control requests against one CacheEngine on a TCP endpoint."""

    def __init__(
        self, engine: CacheEngine, endpoint: str, security: SocketSecurity = PLAIN_SOCKETS
    ) -> None:
        self.engine = engine
        self._security = security
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        security.curve_server(self._socket)
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as exc:
            self._socket.close()
            security.term(self._ctx)
            raise RuntimeError(f"KV tier control service cannot bind {endpoint}: {exc}") from exc
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._decoder = msgspec.msgpack.Decoder(ControlRequest)
        self._encoder = msgspec.msgpack.Encoder()
        self._service = RouterService(self._socket, self._handle, "kv-control")

    def _handle(self, frames: Sequence[zmq.Frame]) -> list[serde.Buffer] | None:
        """[header, *chunks] -> [reply, *chunks]."""
        try:
            request = self._decoder.decode(frames[0].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("kv control: bad request dropped: %s", exc)
            return None
        reply, blobs = self._answer(request, [f.buffer for f in frames[1:]])
        return [self._encoder.encode(reply), *blobs]

    def _answer(
        self, request: ControlRequest, blobs: list[memoryview]
    ) -> tuple[ControlReply, list[serde.Buffer]]:
        """The reply and the chunk frames that follow it."""
        engine = self.engine
        try:
            if isinstance(request, InfoRequest):
                info = TierInfo(
                    engine.metadata.model_name,
                    engine.config.chunk_size,
                    engine.config.hash_seed,
                    engine.config.save_unfull_chunk,
                    [b.medium for b in engine.storage.backends],
                )
                return ControlReply(request.seq, info=info), []
            if isinstance(request, InventoryRequest):
                inventory = {}
                for backend in engine.storage.backends:
                    keys = backend.held_keys()
                    if keys is not None:
                        inventory[backend.medium] = [bytes.fromhex(k.chunk_hash) for k in keys]
                return ControlReply(request.seq, inventory=inventory), []
            if isinstance(request, PinRequest):
                act = engine.unpin_prefix if request.unpin else engine.pin_prefix
                tokens = act(request.tokens, request.medium, tuple(request.tags))
                return ControlReply(request.seq, tokens=tokens), []
            if isinstance(request, ClearRequest):
                engine.clear_medium(request.medium)
                return ControlReply(request.seq), []
            if isinstance(request, ExportRequest):
                chunks = export_chunks(engine, request.tokens, request.medium, tuple(request.tags))
                reply = ControlReply(
                    request.seq, tokens=chunks[-1][0].end if chunks else 0,
                    chunks=[header for header, _ in chunks],
                )  # fmt: skip
                return reply, [blob for _, blob in chunks]
            if len(blobs) != len(request.chunks):
                raise ValueError(f"chunks: {len(request.chunks)} named, {len(blobs)} sent")
            stored, rejected = import_chunks(
                engine, list(zip(request.chunks, blobs, strict=True)), request.medium
            )
            return ControlReply(request.seq, tokens=stored, rejected=rejected), []
        except Exception as exc:  # an answer always goes back: the client must not wait
            logger.warning("kv control request failed: %s", exc)
            return ControlReply(request.seq, error=f"{type(exc).__name__}: {exc}"), []

    def close(self) -> None:
        self._service.close()
        self._socket.close()
        self._security.term(self._ctx)


class ControlError(RuntimeError):
    """The instance did not answer, or answered with an error."""


class ControlClient:
    """One instance's control service, one request at a time (callers serialize)."""

    def __init__(
        self,
        endpoint: str,
        timeout_s: float = CONTROL_TIMEOUT_S,
        security: SocketSecurity = PLAIN_SOCKETS,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._security = security
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        security.curve_client(self._socket)
        self._socket.connect(endpoint)
        self._seq = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ControlReply)
        self._lock = threading.Lock()

    def _ask(
        self,
        make: Callable[[int], ControlRequest],
        timeout_s: float | None = None,
        blobs: Sequence[serde.Buffer] = (),
    ) -> tuple[ControlReply, list[memoryview]]:
        """Sends make(seq) (and chunk frames) and waits for its answer and the chunk
        frames after it; ControlError on none or an error."""
        with self._lock:
            self._seq += 1
            seq = self._seq
            self._socket.send_multipart([self._encoder.encode(make(seq)), *blobs], copy=False)
            deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not self._socket.poll(max(1, int(left * 1000))):
                    raise ControlError(f"{self.endpoint} did not answer")
                frames = self._socket.recv_multipart(copy=False)
                reply = self._decoder.decode(frames[0].buffer)
                if reply.seq == seq:  # older seqs answer requests that timed out
                    break
        if reply.error is not None:
            raise ControlError(reply.error)
        return reply, [f.buffer for f in frames[1:]]

    def info(self, timeout_s: float | None = None) -> TierInfo:
        info = self._ask(InfoRequest, timeout_s)[0].info
        if info is None:
            raise ControlError(f"{self.endpoint} sent no tier info")
        return info

    def inventory(self, timeout_s: float | None = None) -> dict[str, list[bytes]]:
        """Tier -> the chunk hashes it holds now (tiers that cannot list theirs left out)."""
        return self._ask(InventoryRequest, timeout_s)[0].inventory

    def pin(self, tokens: list[int], medium: str, tags: Tags, unpin: bool = False) -> int:
        return self._ask(lambda seq: PinRequest(seq, tokens, medium, list(tags), unpin))[0].tokens

    def clear(self, medium: str) -> None:
        self._ask(lambda seq: ClearRequest(seq, medium))

    def export(self, tokens: list[int], medium: str, tags: Tags) -> list[Chunk]:
        reply, blobs = self._ask(lambda seq: ExportRequest(seq, tokens, medium, list(tags)))
        if len(blobs) != len(reply.chunks):
            raise ControlError(
                f"{self.endpoint}: {len(reply.chunks)} chunks named, {len(blobs)} sent"
            )
        return list(zip(reply.chunks, blobs, strict=True))

    def import_chunks(self, chunks: list[Chunk], medium: str) -> tuple[int, int]:
        """(tokens of the leading run stored, chunks refused)."""
        headers = [header for header, _ in chunks]
        reply, _ = self._ask(
            lambda seq: ImportRequest(seq, medium, headers), blobs=[blob for _, blob in chunks]
        )
        return reply.tokens, reply.rejected

    def close(self) -> None:
        self._socket.close()
        self._security.term(self._ctx)
