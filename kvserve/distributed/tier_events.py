"""The KV tier's events on the wire: each tier's stored / removed chunks published as KV
cache events whose medium is the tier ("cpu", "disk", "remote").

A chunk travels as a one-hash BlockStored (BlockRemoved) whose hash is the tier's 32-byte
chunk hash (kvcache/chunking.py) and whose block_size is the chunk size; token ids are
left out: a follower hashes the prompts it is asked about, it need not rebuild them. The
stream has the engine publisher's format, sequence numbers and replay socket
(kv_events_publisher.py), so `kvserve events` and any KV event subscriber read it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from kvserve.distributed.kv_events_publisher import EventPublisher
from kvserve.kvcache.key import CacheEngineKey
from kvserve.kvcache.tier_events import TierEventSink
from kvserve.protocol.kv_events import BlockRemoved, BlockStored, KVEventBatch


class PublishingTierEventSink(TierEventSink):
    """Publishes each report as one KVEventBatch. The tiers report from several threads
    (the worker, the disk writer): a lock keeps sequence numbers in publishing order."""

    def __init__(self, publisher: EventPublisher, chunk_size: int) -> None:
        self.publisher = publisher
        self.chunk_size = chunk_size
        self._lock = threading.Lock()

    def stored(self, medium: str, keys: Sequence[CacheEngineKey]) -> None:
        hashes = [bytes.fromhex(k.chunk_hash) for k in keys]
        event = BlockStored(hashes, None, [], self.chunk_size, medium=medium)
        with self._lock:
            self.publisher.publish(KVEventBatch(ts=time.time(), events=[event]))

    def removed(self, medium: str, keys: Sequence[CacheEngineKey]) -> None:
        event = BlockRemoved([bytes.fromhex(k.chunk_hash) for k in keys], medium=medium)
        with self._lock:
            self.publisher.publish(KVEventBatch(ts=time.time(), events=[event]))

    def close(self) -> None:
        self.publisher.shutdown()
