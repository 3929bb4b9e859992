"""The pool of KV cache blocks: allocation, reference counts and the prefix-cache map."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvserve.core.kv_cache_utils import (
    BlockContent,
    BlockHash,
    BlockHashWithGroupId,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    get_block_content,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)
from kvserve.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)

if TYPE_CHECKING:
    from kvserve.core.request import Request

# One block per key, or several when requests computed the same block concurrently.
CachedBlocks = KVCacheBlock | dict[int, KVCacheBlock]


def require_integrity(ok: bool, what: str) -> None:
    """The check_integrity() methods' assertion: survives python -O, names the invariant."""
    if not ok:
        raise AssertionError(f"KV cache integrity: {what}")


class BlockPool:
    """Owns every KVCacheBlock; freed blocks keep their hash until they are reused (LRU).

    Block 0 is the null block: a placeholder in block tables (sliding window) that is
    never allocated, freed or cached.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool,
        enable_kv_cache_events: bool = False,
        kv_events_medium: str = "GPU",
    ) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (one is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHashWithGroupId, CachedBlocks] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.enable_kv_cache_events = enable_kv_cache_events
        # "GPU" is vLLM's label for the engine's own paged cache, whatever the device.
        self.kv_events_medium = kv_events_medium
        self.kv_event_queue: list[KVCacheEvent] = []

    # --- prefix-cache map -------------------------------------------------------

    def get_cached_block(
        self,
        block_hash: BlockHash,
        kv_cache_group_ids: Sequence[int],
        content: BlockContent | None = None,
    ) -> list[KVCacheBlock] | None:
        """One cached block per group, or None if any group misses.

        With content given, a block whose tokens/parent/extra keys differ is a miss, so a
        hash collision never hands out another prompt's KV.
        """
        found: list[KVCacheBlock] = []
        for group_id in kv_cache_group_ids:
            entry = self.cached_block_hash_to_block.get(
                make_block_hash_with_group_id(block_hash, group_id)
            )
            candidates = (
                [entry] if isinstance(entry, KVCacheBlock) else list((entry or {}).values())
            )
            match = next((b for b in candidates if content is None or b.content == content), None)
            if match is None:
                return None
            found.append(match)
        return found

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
    ) -> None:
        """Makes blocks[num_cached_blocks:num_full_blocks] prefix-cache entries."""
        if num_cached_blocks >= num_full_blocks:
            return
        if len(request.block_hashes) < num_full_blocks:
            raise ValueError(
                f"request {request.request_id} has {len(request.block_hashes)} block hashes, "
                f"{num_full_blocks} needed: create it with a block_hasher"
            )
        stored: list[bytes] = []
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            if block.is_null:  # skipped by a sliding window: nothing to cache
                continue
            block_hash = request.block_hashes[index]
            key = make_block_hash_with_group_id(block_hash, kv_cache_group_id)
            block.block_hash = key
            block.content = get_block_content(request, index, block_size)
            self._insert(key, block)
            stored.append(block_hash)
        if self.enable_kv_cache_events and stored:
            parent = request.block_hashes[num_cached_blocks - 1] if num_cached_blocks else None
            token_ids = request.all_token_ids[
                num_cached_blocks * block_size : num_full_blocks * block_size
            ]
            self.kv_event_queue.append(
                BlockStored(
                    block_hashes=stored,
                    parent_block_hash=parent,
                    token_ids=list(token_ids),
                    block_size=block_size,
                    medium=self.kv_events_medium,
                    group_id=kv_cache_group_id,
                )
            )

    def _insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        entry = self.cached_block_hash_to_block.get(key)
        if entry is None:
            self.cached_block_hash_to_block[key] = block
        elif isinstance(entry, KVCacheBlock):
            self.cached_block_hash_to_block[key] = {entry.block_id: entry, block.block_id: block}
        else:
            entry[block.block_id] = block

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> None:
        key = block.block_hash
        if key is None:
            return
        entry = self.cached_block_hash_to_block.get(key)
        if isinstance(entry, dict):
            entry.pop(block.block_id, None)
            if len(entry) == 1:
                self.cached_block_hash_to_block[key] = next(iter(entry.values()))
        elif entry is block:
            del self.cached_block_hash_to_block[key]
        block.reset_hash()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(
                BlockRemoved(
                    block_hashes=[get_block_hash(key)],
                    medium=self.kv_events_medium,
                    group_id=get_group_id(key),
                )
            )

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drops these blocks' prefix-cache entries (vLLM's name): their KV may be bad, e.g.
        a failed step was to write it. Ref counts are untouched."""
        for block_id in block_ids:
            self._maybe_evict_cached_block(self.blocks[block_id])

    # --- allocation -------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Takes the least recently freed blocks, evicting their cache entries."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(
                f"cannot get {num_blocks} blocks, only {self.get_num_free_blocks()} free"
            )
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on prefix-cache hits; a free hit leaves the free queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference each; blocks reaching zero join the tail in this order.

        Callers pass a request's blocks tail first, so the end of a chain is evicted
        before its prefix, which other requests are more likely to share.
        """
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"{block} freed more often than it was taken")
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash; refused (False) while any block is in use."""
        if self.get_num_used_blocks():
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.reset_hash()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_num_used_blocks(self) -> int:
        """Blocks held by requests (the null block is never counted)."""
        return self.num_blocks - 1 - self.get_num_free_blocks()

    def get_usage(self) -> float:
        """Fraction of usable blocks (the null block excluded) held by requests."""
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    def take_events(self) -> list[KVCacheEvent]:
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def check_integrity(self) -> None:
        """Raises AssertionError if any invariant of the pool is broken (for tests)."""

        def require(ok: bool, what: str) -> None:
            require_integrity(ok, f"BlockPool: {what}")

        free = self.free_block_queue.get_all_free_blocks()
        free_ids = {b.block_id for b in free}
        require(len(free) == len(free_ids), "a block is in the free queue twice")
        require(len(free) == self.free_block_queue.num_free_blocks, "num_free_blocks is wrong")
        require(self.null_block.block_id not in free_ids, "the null block is in the free queue")
        for prev, nxt in itertools.pairwise(free):
            require(prev.next_free_block is nxt and nxt.prev_free_block is prev, "broken links")
        for block in self.blocks:
            require(block.ref_cnt >= 0, f"{block} has a negative ref_cnt")
            if block.is_null:
                require(block.block_hash is None, "the null block has a hash")
                continue
            in_free = block.block_id in free_ids
            require(in_free == (block.ref_cnt == 0), f"{block} free-queue membership is wrong")
            if block.block_hash is not None:
                found = self.cached_block_hash_to_block.get(block.block_hash)
                held = found.values() if isinstance(found, dict) else [found]
                require(any(m is block for m in held), f"{block} is missing from the map")
        for key, entry in self.cached_block_hash_to_block.items():
            members = list(entry.values()) if isinstance(entry, dict) else [entry]
            require(len(members) > 0, "an empty map entry")
            for member in members:
                require(member.block_hash == key, f"{member} is cached under another hash")
