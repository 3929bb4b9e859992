"""Per-attention-type block bookkeeping: which blocks each request holds in one group."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvserve.core.block_pool import BlockPool
from kvserve.core.kv_cache_utils import BlockHash, KVCacheBlock, get_block_content
from kvserve.protocol.kv_cache_interface import CrossAttentionSpec, KVCacheSpec, cdiv

if TYPE_CHECKING:
    from kvserve.core.request import Request

__all__ = ["CrossAttentionManager", "FullAttentionManager", "SingleTypeKVCacheManager", "cdiv"]


class SingleTypeKVCacheManager(ABC):
    """Block tables of one KV cache group (layers with the same spec)."""

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        enable_caching: bool,
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self.enable_caching = enable_caching
        # Only requests that hold blocks are keys: get_num_common_prefix_blocks counts them.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already prefix-cache entries.
        self.num_cached_block: dict[str, int] = {}

    def note_request(self, request: Request) -> None:
        """Reads what this group needs of a request beyond its id, before its allocation
        (the cross-attention manager: the hash of its encoder input)."""
        return None

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Free-queue blocks needed to hold num_tokens, counting free prefix hits.

        A hit on a block with ref_cnt 0 takes it out of the free queue, so it costs
        one free block just like a fresh allocation.
        """
        num_held = len(self.req_to_blocks.get(request_id, ()))
        num_new = max(cdiv(num_tokens, self.block_size) - len(new_computed_blocks) - num_held, 0)
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return num_new + num_evictable_hits

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        """Puts a newly scheduled request's prefix hits at the start of its table."""
        if request_id not in self.num_cached_block:
            assert request_id not in self.req_to_blocks, f"{request_id} already holds blocks"
            self.req_to_blocks[request_id] = list(new_computed_blocks)
            self.num_cached_block[request_id] = len(new_computed_blocks)
        else:
            # Hits are only looked up before a request's first scheduling.
            assert not new_computed_blocks, f"{request_id} is running and got new hits"

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Makes the request's blocks that are full within num_tokens cache entries."""
        num_cached = self.num_cached_block.get(request.request_id, 0)
        num_full = num_tokens // self.block_size
        if num_cached >= num_full:
            return
        self.block_pool.cache_full_blocks(
            request,
            self.req_to_blocks[request.request_id],
            num_cached,
            num_full,
            self.block_size,
            self.kv_cache_group_id,
        )
        self.num_cached_block[request.request_id] = num_full

    def free(self, request_id: str) -> None:
        # Tail first: the end of a chain is the least likely to be shared, evict it first.
        blocks = self.req_to_blocks.pop(request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request_id, None)

    # Leading blocks that stay whatever the window (attention sinks).
    num_kept_leading_blocks = 0
    # A request's table covers its computed tokens (false for a Mamba group's one block).
    tracks_token_slots = True

    def check_integrity(self) -> None:
        """The manager's own invariants beyond the pool's (the coordinator's check);
        the block-table rules the coordinator checks for every group are all there are."""
        return

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens that no query from position num_computed_tokens on attends to
        (beyond the kept leading blocks); none for full attention."""
        return 0

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Frees the blocks no future token attends to, leaving null_block in their place
        so block indices still match token positions."""
        num_skipped = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        blocks = self.req_to_blocks.get(request_id)
        if num_skipped <= self.num_kept_leading_blocks or not blocks:
            return
        null_block = self.block_pool.null_block
        removed: list[KVCacheBlock] = []
        # Walk back from the newest skipped block; everything before a null is null already.
        for index in range(min(num_skipped, len(blocks)) - 1, self.num_kept_leading_blocks - 1, -1):
            if blocks[index].is_null:
                break
            removed.append(blocks[index])
            blocks[index] = null_block
        self.block_pool.free_blocks(removed)

    def request_census(self) -> dict[str, int]:
        return {
            "req_to_blocks": len(self.req_to_blocks),
            "num_cached_block": len(self.num_cached_block),
        }

    def num_live_blocks(self, request_id: str) -> int:
        """Blocks a request really holds (null placeholders excluded)."""
        return sum(1 for b in self.req_to_blocks.get(request_id, ()) if not b.is_null)

    @abstractmethod
    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Leading blocks that every running request shares (for cascade attention)."""

    @classmethod
    @abstractmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        request: Request | None = None,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Cached blocks (one list per group) of the longest prefix within max_length tokens.

        With request given, each hit's stored tokens are compared with the request's.
        """


class FullAttentionManager(SingleTypeKVCacheManager):
    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        num_holders = len(self.req_to_blocks)
        count = 0
        for block in self.req_to_blocks.get(running_request_id, ()):
            if block.ref_cnt != num_holders:
                break
            count += 1
        return count

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        request: Request | None = None,
    ) -> tuple[list[KVCacheBlock], ...]:
        hits: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        max_blocks = min(max_length // kv_cache_spec.block_size, len(block_hashes))
        for index in range(max_blocks):
            content = (
                get_block_content(request, index, kv_cache_spec.block_size) if request else None
            )
            cached = block_pool.get_cached_block(block_hashes[index], kv_cache_group_ids, content)
            if cached is None:
                break  # a prefix hit ends at the first miss
            for group_hits, block in zip(hits, cached, strict=True):
                group_hits.append(block)
        return hits


class CrossAttentionManager(SingleTypeKVCacheManager):
    """The blocks of a request's encoder output K/V (vLLM's CrossAttentionManager).

    All ``max_encoder_len`` positions are allocated at the request's first allocation,
    whatever its decoder tokens, and held until it is freed. They are never prefix-cache
    entries (the decoder's token hashes say nothing of the audio): they are keyed by the
    encoder input's hash instead, so a request whose encoder input equals a running
    request's takes a reference on the same blocks rather than new ones. A key lives as
    long as some request holds its blocks.
    """

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        enable_caching: bool,
    ) -> None:
        if not isinstance(kv_cache_spec, CrossAttentionSpec):
            raise TypeError("CrossAttentionManager needs a CrossAttentionSpec")
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id, enable_caching)
        self.num_encoder_blocks = cdiv(kv_cache_spec.max_encoder_len, self.block_size)
        self.req_to_encoder_key: dict[str, str] = {}
        self.encoder_key_to_blocks: dict[str, list[KVCacheBlock]] = {}

    def note_request(self, request: Request) -> None:
        if request.mm_features and request.request_id not in self.req_to_encoder_key:
            self.req_to_encoder_key[request.request_id] = request.mm_features[0].identifier

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        key = self.req_to_encoder_key.get(request_id)
        if key is None or request_id in self.req_to_blocks:
            return 0
        # Shared blocks are held by a live request: a reference costs no free block.
        return 0 if key in self.encoder_key_to_blocks else self.num_encoder_blocks

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        assert not new_computed_blocks, "cross-attention blocks are never prefix hits"

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """The request's encoder blocks at its first allocation (shared ones included:
        they are new to its block table), nothing after."""
        key = self.req_to_encoder_key.get(request_id)
        if key is None or request_id in self.req_to_blocks:
            return []
        shared = self.encoder_key_to_blocks.get(key)
        if shared is not None:
            self.block_pool.touch(shared)
            blocks = list(shared)
        else:
            blocks = self.block_pool.get_new_blocks(self.num_encoder_blocks)
            self.encoder_key_to_blocks[key] = blocks
        self.req_to_blocks[request_id] = list(blocks)
        return list(blocks)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        pass  # keyed by the encoder input, never by the decoder's token hashes

    def free(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, [])
        key = self.req_to_encoder_key.pop(request_id, None)
        self.block_pool.free_blocks(reversed(blocks))
        if key is not None and blocks and blocks[0].ref_cnt == 0:
            del self.encoder_key_to_blocks[key]

    def request_census(self) -> dict[str, int]:
        return {
            **super().request_census(),
            "req_to_encoder_key": len(self.req_to_encoder_key),
            "encoder_key_to_blocks": len(self.encoder_key_to_blocks),
        }

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        return 0

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        request: Request | None = None,
    ) -> tuple[list[KVCacheBlock], ...]:
        # No decoder-token prefix can stand for an encoder output (encoder-decoder models
        # run with prefix caching off; a hybrid lookup through here finds nothing).
        return tuple([] for _ in kv_cache_group_ids)
