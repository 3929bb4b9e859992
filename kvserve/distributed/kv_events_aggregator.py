"""KVEventAggregator: the KV cache events that every worker reported.

With tensor parallelism each worker holds a shard of the same blocks, so a block is
really stored (or removed) only once all workers say so; publishing one worker's view
would announce blocks another worker never kept. The aggregator keeps the multiset
intersection of the workers' events: an event reported twice by every worker is kept
twice, one reported by only some workers is dropped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import msgspec

from kvserve.protocol.kv_events import KVEvent, KVEventBatch

# Structs with list fields are not hashable: events are compared by their encoding,
# which is canonical for equal events (same type tag, same field order).
_encoder = msgspec.msgpack.Encoder()


def _key(event: KVEvent) -> bytes:
    return _encoder.encode(event)


class KVEventAggregator:
    """Collects one list of events per worker, then hands out the common ones."""

    def __init__(self, num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self.num_workers = num_workers
        self._per_worker: list[list[KVEvent]] = []

    def add_events(self, events: Sequence[KVEvent]) -> None:
        """Adds one worker's events (call once per worker per round)."""
        if len(self._per_worker) == self.num_workers:
            raise RuntimeError(
                f"already holds events of all {self.num_workers} workers: "
                "call get_common_events() or clear_events() first"
            )
        self._per_worker.append(list(events))

    def get_common_events(self) -> list[KVEvent]:
        """Events every worker reported, in the first worker's order; clears the round.

        A worker that has not reported yet counts as reporting nothing.
        """
        per_worker, self._per_worker = self._per_worker, []
        if len(per_worker) < self.num_workers:
            return []
        remaining = Counter(_key(e) for e in per_worker[0])
        for events in per_worker[1:]:
            remaining &= Counter(_key(e) for e in events)
        common: list[KVEvent] = []
        for event in per_worker[0]:
            key = _key(event)
            if remaining[key] > 0:
                remaining[key] -= 1
                common.append(event)
        return common

    def clear_events(self) -> None:
        self._per_worker = []

    @classmethod
    def aggregate(cls, batches: Sequence[KVEventBatch]) -> KVEventBatch:
        """One batch of the events common to the given batches, one batch per worker.

        Its timestamp is the latest of theirs: by then every worker had the events.
        """
        if not batches:
            raise ValueError("aggregate() needs at least one batch")
        aggregator = cls(len(batches))
        for batch in batches:
            aggregator.add_events(batch.events)
        return KVEventBatch(ts=max(b.ts for b in batches), events=aggregator.get_common_events())
