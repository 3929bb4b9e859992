"""The instances behind the router: their URLs, their KV event streams, their load.

One thread per instance follows its KV events into the shared PrefixIndex. A gap in the
sequence numbers (the router missed batches) is filled from the instance's replay
socket; when the stream falls silent past its health checks or the instance's /health
fails, the instance leaves the index and the routing choices until it answers again, and
its blocks are then learned afresh (a restarted instance starts with an empty cache and
new sequence numbers).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from kvserve.core.prefix_index import PrefixIndex
from kvserve.distributed.kv_events_subscriber import KVEventSubscriber
from kvserve.utils.zmq_curve import PLAIN_SOCKETS, SocketSecurity

logger = logging.getLogger(__name__)


@dataclass
class Backend:
    """One instance: ``url`` serves the OpenAI API, ``events`` publishes its KV events
    (``replay``: the replay socket, optional)."""

    url: str
    events: str
    replay: str | None = None
    topic: str = ""
    in_flight: int = 0
    healthy: bool = True
    routed: int = 0
    last_seq: int = -1
    _thread: threading.Thread | None = field(default=None, repr=False)

    @classmethod
    def parse(cls, spec: str, events_required: bool = True) -> Backend:
        """``URL=EVENTS[,REPLAY]``, e.g. ``http://h:8001=tcp://h:5557,tcp://h:5558``; a plain
        ``URL`` where a cache controller follows the events instead (events_required off)."""
        url, sep, sockets = spec.partition("=")
        if not sep and not events_required and url.startswith(("http://", "https://")):
            return cls(url.rstrip("/"), "")
        if not sep or not url.startswith(("http://", "https://")) or not sockets:
            raise ValueError(
                f"--backend {spec!r}: expected URL=EVENTS_ENDPOINT[,REPLAY_ENDPOINT], e.g. "
                "http://127.0.0.1:8001=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558"
            )
        events, _, replay = sockets.partition(",")
        return cls(url.rstrip("/"), events, replay or None)


class EventFollowers:
    """Follows every backend's KV events into ``index`` (under ``lock``) until stopped."""

    def __init__(
        self,
        backends: list[Backend],
        index: PrefixIndex,
        lock: threading.Lock,
        security: SocketSecurity = PLAIN_SOCKETS,
    ) -> None:
        self.backends = backends
        self.security = security
        self.index = index
        self.lock = lock
        self._stop = threading.Event()

    def start(self) -> None:
        for backend in self.backends:
            if not backend.events:  # a cache controller follows this one's events
                continue
            backend._thread = threading.Thread(
                target=self._follow, args=(backend,), name=f"kv-events {backend.url}", daemon=True
            )
            backend._thread.start()

    def stop(self) -> None:
        self._stop.set()
        for backend in self.backends:
            if backend._thread is not None:
                backend._thread.join(timeout=5)

    def reset(self, backend: Backend) -> None:
        """Forget what the backend held (it went away or restarted)."""
        with self.lock:
            self.index.forget(backend.url)
            backend.last_seq = -1

    def _follow(self, backend: Backend) -> None:
        subscriber = KVEventSubscriber(backend.events, backend.replay, backend.topic, self.security)
        with subscriber as sub:
            while not self._stop.is_set():
                got = sub.recv(timeout=0.2)
                if got is None:
                    continue
                seq, batch = got
                if backend.last_seq >= 0 and seq > backend.last_seq + 1 and backend.replay:
                    self._replay(sub, backend, backend.last_seq + 1, seq)
                elif seq <= backend.last_seq:  # numbering restarted: a new process
                    self.reset(backend)
                with self.lock:
                    self.index.apply(backend.url, batch.events)
                backend.last_seq = seq

    def _replay(self, sub: KVEventSubscriber, backend: Backend, start: int, upto: int) -> None:
        try:
            for seq, batch in sub.replay(start):
                if seq >= upto:  # the live stream delivers these (read on: one answer)
                    continue
                with self.lock:
                    self.index.apply(backend.url, batch.events)
        except TimeoutError:
            # The gap cannot be filled: what the index holds for it may be wrong.
            logger.warning(
                "%s: KV events %d-%d lost, relearning its cache", backend.url, start, upto
            )
            self.reset(backend)
