"""TierIndex: the controller hashes prompts as the engine's block pool and the KV tier
do, so the events they publish answer its lookups per tier."""

from __future__ import annotations

import pytest
import torch

from kvserve.core.prefix_index import PrefixIndex
from kvserve.distributed.kv_events_publisher import EventPublisher
from kvserve.distributed.tier_events import PublishingTierEventSink
from kvserve.entrypoints.cache_controller.index import HashLayout, TierIndex, tier_of
from kvserve.kvcache import CacheEngine, CacheEngineConfig, CacheEngineMetadata
from kvserve.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

LAYOUT = HashLayout(block_size=4, block_hash_seed=7, chunk_size=8, chunk_hash_seed=3)


class KeptBatches(EventPublisher):
    """A publisher that keeps its batches in memory (the wire is tested elsewhere)."""

    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []

    def publish(self, events: KVEventBatch) -> None:
        self.batches.append(events)

    def shutdown(self) -> None:
        return None


def test_device_blocks_follow_the_engines_hashes() -> None:
    tokens = list(range(30))
    # The router's index hashes exactly as the engine's block pool does.
    engine_hashes = PrefixIndex(4, hash_seed=7).block_hashes(tokens, "salt")
    assert LAYOUT.block_hashes(tokens, "salt") == engine_hashes
    index = TierIndex()
    index.apply("a", [BlockStored(engine_hashes[:3], None, tokens[:12], 4, medium="GPU")])
    index.apply("a", [BlockStored(engine_hashes[3:5], None, [], 4, medium="GPU", group_id=1)])
    assert index.match("a", LAYOUT.hash(tokens, "salt")) == {"device": 12}
    assert index.match("a", LAYOUT.hash(tokens, None)) == {}  # another salt, other hashes
    index.apply("a", [BlockRemoved(engine_hashes[1:2], medium="GPU")])
    assert index.match("a", LAYOUT.hash(tokens, "salt")) == {"device": 4}
    index.apply("a", [AllBlocksCleared()])
    assert index.match("a", LAYOUT.hash(tokens, "salt")) == {}


def test_tier_events_answer_lookups_per_tier() -> None:
    config = CacheEngineConfig(chunk_size=8, hash_seed=3, max_local_cpu_size=1 << 20)
    engine = CacheEngine(config, CacheEngineMetadata("m"))
    kept = KeptBatches()
    engine.storage.attach_events(PublishingTierEventSink(kept, 8))
    tokens = list(range(20))
    engine.store(tokens, torch.zeros(1, 2, 20, 1, 2), tags=(("salt", "s"),))
    index = TierIndex()
    for batch in kept.batches:
        index.apply("a", batch.events)
    assert index.match("a", LAYOUT.hash(tokens, "s")) == {"cpu": 16}
    assert index.match("a", LAYOUT.hash(tokens[:12], "s")) == {"cpu": 8}
    assert index.counts("a") == {"cpu": 2}
    engine.clear_medium("cpu")
    for batch in kept.batches[2:]:
        index.apply("a", batch.events)
    assert index.match("a", LAYOUT.hash(tokens, "s")) == {}
    engine.close()


def test_media() -> None:
    assert [tier_of(m) for m in (None, "GPU", "cpu", "CPU", "disk", "remote")] == [
        "device", "device", "cpu", "cpu", "disk", "remote",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="medium 'tape'"):
        tier_of("tape")
