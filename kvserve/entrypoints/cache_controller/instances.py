"""The instances a cache controller knows: how to reach them, how they hash, and one
thread per KV event stream (the engine's, the tier's) following it into the TierIndex.

A stream whose sequence numbers restart (the instance restarted) or skip (batches were
lost: a PUB socket drops what its subscriber could not take) makes the index forget what
that stream taught it, then ask the instance what its tiers hold now (``resync``); later
events go on from there. The first batch of a stream is followed by a listing too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.distributed.kv_events_subscriber import KVEventSubscriber
from kvserve.entrypoints.cache_controller.index import HashLayout, TierIndex
from kvserve.kvcache.control import ControlClient, TierInfo
from kvserve.utils.zmq_curve import PLAIN_SOCKETS, SocketSecurity

logger = logging.getLogger(__name__)


@dataclass
class Instance:
    name: str
    url: str
    control: ControlClient
    info: TierInfo
    layout: HashLayout
    # endpoint -> the tiers its events describe (the engine's: device; the tier's: its media)
    streams: dict[str, list[str]]
    _threads: list[threading.Thread] = field(default_factory=list, repr=False)

    @property
    def tiers(self) -> list[str]:
        return [t for tiers in self.streams.values() for t in tiers] or list(self.info.media)


class StreamFollowers:
    """Follows the instances' event streams into ``index`` (under ``lock``) until stopped."""

    def __init__(
        self,
        index: TierIndex,
        lock: threading.Lock,
        resync: Callable[[str], None],
        security: SocketSecurity = PLAIN_SOCKETS,
    ) -> None:
        self.index = index
        self.lock = lock
        self.resync = resync
        self.security = security
        self._stops: dict[str, threading.Event] = {}

    def start(self, instance: Instance) -> None:
        """Connects to every stream of the instance; returns once each is subscribed."""
        stop = self._stops[instance.name] = threading.Event()
        for endpoint, tiers in instance.streams.items():
            ready = threading.Event()
            thread = threading.Thread(
                target=self._follow,
                args=(instance.name, endpoint, tiers, stop, ready),
                name=f"tier-events {instance.name}",
                daemon=True,
            )
            thread.start()
            ready.wait(5)
            instance._threads.append(thread)

    def stop(self, instance: Instance) -> None:
        stop = self._stops.pop(instance.name, None)
        if stop is not None:
            stop.set()
        for thread in instance._threads:
            thread.join(timeout=5)
        instance._threads.clear()

    def _follow(
        self,
        name: str,
        endpoint: str,
        tiers: list[str],
        stop: threading.Event,
        ready: threading.Event,
    ) -> None:
        last_seq = -1
        with KVEventSubscriber(endpoint, security=self.security) as sub:
            ready.set()
            while not stop.is_set():
                got = sub.recv(timeout=0.2)
                if got is None:
                    continue
                seq, batch = got
                if last_seq >= 0 and seq != last_seq + 1:
                    # Restarted (new numbering) or lost batches: what it taught is stale.
                    logger.warning(
                        "%s: KV events %s jumped %d -> %d", name, endpoint, last_seq, seq
                    )
                    with self.lock:
                        self.index.forget(name, tiers)
                    self.resync(name)
                elif last_seq < 0:
                    # The first batch: a SUB socket gets nothing until its subscription
                    # has reached the publisher, so what came before is taken from a
                    # listing made now (the events after it apply on top).
                    self.resync(name)
                last_seq = seq
                try:
                    with self.lock:
                        self.index.apply(name, batch.events)
                except ValueError as exc:
                    logger.warning("%s: KV events %s: %s", name, endpoint, exc)
