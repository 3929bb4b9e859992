"""The lookup service: a CacheEngine's lookups answered for another process, over ZMQ.

Under tensor parallelism every rank's CacheEngine holds that rank's shard of each chunk
(its own KV heads, keyed worker_id = rank), in tiers that may be private to the rank (CPU,
disk) or shared (Redis). Whoever plans loads (an engine's scheduler) owns no CacheEngine:
it asks each rank's LookupServer and takes the minimum, because a prefix can be loaded
only as far as every rank holds its shard. Asking every rank, rather than rank 0 checking
the other ranks' keys, is what keeps private tiers right: rank 1's CPU tier is visible
to rank 1 alone. (LMCache's lookup client and server split the work the same way.)

A lookup with a lookup id pins what it found on that rank until the rank retrieves or
releases it, so nothing is evicted between the answer and the load.

Wire: the server binds a ROUTER socket, the client one DEALER socket per rank; each
message is one msgpack frame of the typed structs below (never pickle). A reply carries
the request's sequence number, so a late answer to a timed-out request is dropped. Over
TCP (ranks on other machines) the sockets are CURVE when a KV secret is set
(kvserve.utils.zmq_curve): a client without it is refused, and its lookups are misses.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec
import zmq

from kvserve.kvcache.shared import SharedByKey
from kvserve.utils.zmq_curve import PLAIN_SOCKETS, SocketSecurity
from kvserve.utils.zmq_service import RouterService

if TYPE_CHECKING:
    from kvserve.kvcache.cache_engine import CacheEngine

logger = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = float(os.environ.get("KVSERVE_KV_LOOKUP_TIMEOUT", "10"))


class LookupRequest(msgspec.Struct, tag="lookup"):
    seq: int
    tokens: list[int]
    lookup_id: str | None = None
    tags: list[tuple[str, str]] = []


class StatsRequest(msgspec.Struct, tag="stats"):
    seq: int


class TierCounts(msgspec.Struct):
    hits: int = 0
    misses: int = 0
    bytes_stored: int = 0
    bytes_retrieved: int = 0
    evictions: int = 0
    errors: int = 0
    auth_failures: int = 0


class EngineStats(msgspec.Struct):
    """A CacheEngine's counters (CacheStats.snapshot, typed for the wire)."""

    tiers: dict[str, TierCounts] = {}
    store_latency: tuple[int, float] = (0, 0.0)
    retrieve_latency: tuple[int, float] = (0, 0.0)
    lookup_requests: int = 0
    lookup_query_tokens: int = 0
    lookup_hit_tokens: int = 0


class LookupReply(msgspec.Struct):
    seq: int
    hit: int = 0
    stats: EngineStats | None = None
    error: str | None = None


Request = LookupRequest | StatsRequest


def lookup_address(instance_id: str, rank: int) -> str:
    """The ipc endpoint of one rank's LookupServer. The id is hashed: ipc paths are short
    (108 bytes), an engine id may not be."""
    digest = hashlib.sha256(instance_id.encode()).hexdigest()[:16]
    return f"ipc://{tempfile.gettempdir()}/kvserve-kvlookup-{digest}-{rank}.sock"


class LookupServer:
    """Answers lookups and stats requests against one CacheEngine, in a daemon thread.

    One per address in a process: users that share a CacheEngine (connectors of one
    engine id) share its server through acquire / release."""

    _shared: ClassVar[SharedByKey[LookupServer]] = SharedByKey(lambda server: server.close())

    @classmethod
    def acquire(
        cls,
        engine: CacheEngine,
        key: str,
        tcp_host: str | None = None,
        security: SocketSecurity = PLAIN_SOCKETS,
    ) -> LookupServer:
        """The server registered under ``key`` (its ipc address), started if none is.
        ``tcp_host``: listen on a free TCP port of that address instead (this node's IP,
        for ranks on other machines: Ray nodes), not of every interface; ``address`` says
        where; ``security`` applies to TCP only."""

        def same_engine(server: LookupServer) -> None:
            if server.engine is not engine:
                raise ValueError(f"lookup address {key} serves another CacheEngine")

        return cls._shared.acquire(key, lambda: cls(engine, key, tcp_host, security), same_engine)

    @classmethod
    def release(cls, key: str) -> None:
        cls._shared.release(key)

    def __init__(
        self,
        engine: CacheEngine,
        key: str,
        tcp_host: str | None = None,
        security: SocketSecurity = PLAIN_SOCKETS,
    ) -> None:
        self.engine = engine
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # An ipc path is this machine's only: file permissions guard it, CURVE is not needed.
        self._security = security if tcp_host is not None else PLAIN_SOCKETS
        if tcp_host is not None:
            security.curve_server(self._socket)
            port = self._socket.bind_to_random_port(f"tcp://{tcp_host}")
            self.address = f"tcp://{tcp_host}:{port}"
        else:
            path = key.removeprefix("ipc://")
            if os.path.exists(path):
                # Another live engine with the same engine_id would lose its lookups to
                # us; a file left by a killed process is taken over.
                logger.warning("lookup socket %s exists; taking it over", path)
            self._socket.bind(key)
            self.address = key
        self._decoder = msgspec.msgpack.Decoder(Request)
        self._encoder = msgspec.msgpack.Encoder()
        self._service = RouterService(self._socket, self._handle, "kv-lookup")

    def _handle(self, frames: Sequence[zmq.Frame]) -> list[bytes] | None:
        try:
            request = self._decoder.decode(frames[0].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("kv lookup: bad request dropped: %s", exc)
            return None
        return [self._encoder.encode(self._answer(request))]

    def _answer(self, request: Request) -> LookupReply:
        try:
            if isinstance(request, StatsRequest):
                snap: dict[str, Any] = self.engine.stats.snapshot()
                return LookupReply(request.seq, stats=msgspec.convert(snap, EngineStats))
            hit = self.engine.lookup(request.tokens, request.lookup_id, tuple(request.tags))
            return LookupReply(request.seq, hit=hit)
        except Exception as exc:  # an answer always goes back: the client must not wait
            logger.exception("kv lookup failed")
            return LookupReply(request.seq, error=f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        self._service.close()
        self._socket.close()
        self._security.term(self._ctx)


class LookupClient:
    """Asks every rank's LookupServer; a prefix counts as far as the rank holding the least
    of it. A rank that does not answer in time counts as a miss (0), never a hang."""

    def __init__(
        self,
        addresses: list[str],
        timeout_s: float = LOOKUP_TIMEOUT_S,
        security: SocketSecurity = PLAIN_SOCKETS,
    ) -> None:
        self.timeout_ms = int(timeout_s * 1000)
        self.addresses = list(addresses)
        self._ctx = zmq.Context()
        self._sockets = []
        for address in addresses:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if address.startswith("tcp://"):
                security.curve_client(sock)
            sock.connect(address)
            self._sockets.append(sock)
        self._seq = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(LookupReply)

    def _ask(self, make: Any) -> list[LookupReply | None]:
        """Sends make(seq) to every rank; the replies in rank order (None: no answer)."""
        self._seq += 1
        seq = self._seq
        frame = self._encoder.encode(make(seq))
        for sock in self._sockets:
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:  # no pipe: the rank refused our handshake; it counts as a miss
                pass
        replies: list[LookupReply | None] = [None] * len(self._sockets)
        poller = zmq.Poller()
        for sock in self._sockets:
            poller.register(sock, zmq.POLLIN)
        index = {sock: i for i, sock in enumerate(self._sockets)}
        deadline = time.monotonic() + self.timeout_ms / 1000
        while any(r is None for r in replies):
            left_ms = int((deadline - time.monotonic()) * 1000)
            events = dict(poller.poll(max(0, left_ms))) if left_ms > 0 else {}
            if not events:
                break
            for sock in events:
                got = self._decoder.decode(sock.recv())
                if got.seq == seq:  # an older seq answers a request that timed out
                    replies[index[sock]] = got
        for rank, reply in enumerate(replies):
            if reply is None:
                logger.warning("kv lookup: rank %d did not answer in %d ms", rank, self.timeout_ms)
            elif reply.error is not None:
                logger.warning("kv lookup: rank %d failed: %s", rank, reply.error)
        return replies

    def lookup(
        self, tokens: list[int], lookup_id: str | None, tags: tuple[tuple[str, str], ...]
    ) -> int:
        replies = self._ask(lambda seq: LookupRequest(seq, tokens, lookup_id, list(tags)))
        return min((r.hit if r is not None and r.error is None else 0) for r in replies)

    def stats(self) -> list[EngineStats]:
        """Each answering rank's counters."""
        replies = self._ask(StatsRequest)
        return [r.stats for r in replies if r is not None and r.stats is not None]

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()
        self._ctx.term()
