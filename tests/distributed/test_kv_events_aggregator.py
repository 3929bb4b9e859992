"""KVEventAggregator keeps the events every worker reported."""

from __future__ import annotations

import pytest

from kvserve.distributed.kv_events_aggregator import KVEventAggregator
from kvserve.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)


def stored(i: int, medium: str = "GPU") -> BlockStored:
    return BlockStored(
        block_hashes=[bytes([i]) * 32],
        parent_block_hash=None,
        token_ids=[i, i + 1],
        block_size=2,
        medium=medium,
    )


def removed(i: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=[bytes([i]) * 32], medium="GPU")


def test_keeps_only_events_common_to_all_workers_in_order() -> None:
    aggregator = KVEventAggregator(num_workers=3)
    aggregator.add_events([stored(1), stored(2), removed(3), AllBlocksCleared()])
    aggregator.add_events([AllBlocksCleared(), stored(2), stored(1), removed(3)])
    aggregator.add_events([stored(1), removed(3), AllBlocksCleared(), stored(9)])
    # stored(2) is missing on worker 3, stored(9) on workers 1 and 2.
    assert aggregator.get_common_events() == [stored(1), removed(3), AllBlocksCleared()]
    # The round is over: the next one starts empty.
    aggregator.add_events([stored(5)])
    aggregator.add_events([stored(5)])
    aggregator.add_events([stored(5)])
    assert aggregator.get_common_events() == [stored(5)]


def test_equal_means_every_field_and_repeats_count() -> None:
    aggregator = KVEventAggregator(num_workers=2)
    aggregator.add_events([stored(1), stored(1), stored(2, medium="GPU")])
    aggregator.add_events([stored(1), stored(2, medium="CPU")])
    assert aggregator.get_common_events() == [stored(1)]


def test_a_worker_that_did_not_report_means_nothing_is_common() -> None:
    aggregator = KVEventAggregator(num_workers=2)
    aggregator.add_events([stored(1)])
    assert aggregator.get_common_events() == []
    aggregator.add_events([stored(1)])
    aggregator.add_events([stored(1)])
    with pytest.raises(RuntimeError, match="all 2 workers"):
        aggregator.add_events([stored(1)])
    aggregator.clear_events()
    assert aggregator.get_common_events() == []
    with pytest.raises(ValueError):
        KVEventAggregator(num_workers=0)


def test_aggregate_batches_takes_the_latest_timestamp() -> None:
    batches = [
        KVEventBatch(ts=1.0, events=[stored(1), removed(2)]),
        KVEventBatch(ts=3.0, events=[removed(2), stored(1)]),
        KVEventBatch(ts=2.0, events=[stored(1)]),
    ]
    assert KVEventAggregator.aggregate(batches) == KVEventBatch(ts=3.0, events=[stored(1)])
    single = KVEventBatch(ts=5.0, events=[AllBlocksCleared()])
    assert KVEventAggregator.aggregate([single]) == single
