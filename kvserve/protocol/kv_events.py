"""KV cache events: what the block pool stored, evicted or cleared.

External KV indexes (a router, the shared KV tier) follow the engine's prefix cache
through these events. They are msgspec Structs, tagged so a decoder can tell them apart
inside one batch; publishing them (ZMQ) lives elsewhere.
"""

from __future__ import annotations

import msgspec


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of all KV cache events."""


class BlockStored(KVCacheEvent):
    """Full blocks that became reusable prefix-cache entries, in chain order."""

    block_hashes: list[bytes]
    # Hash of the block before block_hashes[0]; None when the chain starts at the root.
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    # Which cache holds the blocks, e.g. "GPU" for the engine's paged device cache.
    medium: str | None = None
    # The KV cache group (hybrid models: e.g. sliding-window vs global layers); the
    # same tokens are stored once per group, so an index keys on (hash, group).
    group_id: int | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks whose prefix-cache entries were evicted."""

    block_hashes: list[bytes]
    medium: str | None = None
    group_id: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]


class KVEventBatch(EventBatch):
    """The events of one engine step, stamped with the time they were taken."""
