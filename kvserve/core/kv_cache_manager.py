"""The scheduler's interface to the paged KV cache: prefix hits, allocation, freeing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.core.kv_cache_coordinator import get_kv_cache_coordinator
from kvserve.core.kv_cache_utils import KVCacheBlock
from kvserve.protocol.kv_cache_interface import KVCacheConfig
from kvserve.protocol.kv_events import KVCacheEvent

if TYPE_CHECKING:
    from kvserve.core.request import Request


@dataclass
class KVCacheBlocks:
    """Blocks of one request (or of one allocation), one sequence per KV cache group."""

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(
            tuple([*a, *b] for a, b in zip(self.blocks, other.blocks, strict=True))
        )

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.blocks)

    def is_empty(self) -> bool:
        return not any(self.blocks)


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last read, counted in tokens."""

    reset: bool = False  # the cache was cleared in this interval
    requests: int = 0
    queries: int = 0
    hits: int = 0


class KVCacheManager:
    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool = True,
        hash_block_size: int | None = None,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        # Bounds what a windowed group holds at once (the window plus one step's tokens).
        self.max_num_batched_tokens = max_num_batched_tokens or max_model_len
        self.enable_caching = enable_caching
        self.num_groups = len(kv_cache_config.kv_cache_groups)
        self.block_size = kv_cache_config.block_size if self.num_groups else 1
        if hash_block_size is not None and hash_block_size != self.block_size:
            raise NotImplementedError(
                f"hash_block_size {hash_block_size} != KV block size {self.block_size}"
            )
        self.log_stats = log_stats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.coordinator = get_kv_cache_coordinator(
            kv_cache_config, max_model_len, enable_caching, enable_kv_cache_events
        )
        self.block_pool = self.coordinator.block_pool
        # Shared and immutable: the "nothing" answer of get_computed_blocks / allocate_slots.
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in range(self.num_groups)))

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_blocks_in_use(self) -> int:
        return self.block_pool.get_num_used_blocks()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Returns the stats since the last call and starts a new interval."""
        if self.prefix_cache_stats is None:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def fits_in_pool(self, num_tokens: int) -> bool:
        """Whether num_tokens could ever be held, with every other request gone."""
        num_tokens = min(num_tokens, self.max_model_len)
        needed = sum(
            group.kv_cache_spec.max_num_blocks(num_tokens, self.max_num_batched_tokens)
            for group in self.kv_cache_config.kv_cache_groups
        )
        return needed <= self.block_pool.num_blocks - 1

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of a request not yet scheduled: (blocks, num tokens).

        The last token is always recomputed, even when the whole prompt is cached,
        because its logits are needed to sample the next token.
        """
        if not self.enable_caching or not request.use_prefix_cache_reads:
            return self.empty_kv_cache_blocks, 0
        blocks, num_hit_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1, request
        )
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.requests += 1
            self.prefix_cache_stats.queries += request.num_tokens
            self.prefix_cache_stats.hits += num_hit_tokens
        return KVCacheBlocks(blocks), num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_external_computed_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Gives the request slots for num_new_tokens more tokens; None if blocks run short.

        On None nothing changed. On success the prefix hits are taken, new blocks
        appended, and blocks that will be full once this step ran become cache entries
        (unless delay_cache_blocks, for KV still arriving from a connector).
        """
        if num_new_tokens <= 0 and num_external_computed_tokens <= 0:
            raise ValueError("allocate_slots needs num_new_tokens > 0")
        hits = (new_computed_blocks or self.empty_kv_cache_blocks).blocks
        request_id = request.request_id
        self.coordinator.note_request(request)
        self.coordinator.remove_skipped_blocks(request_id, request.num_computed_tokens)
        # External tokens (loaded by a connector) get fresh blocks, like computed ones.
        num_computed_tokens = (
            request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens
        )
        num_tokens_need_slot = min(
            num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len
        )
        num_to_allocate = self.coordinator.get_num_blocks_to_allocate(
            request_id, num_tokens_need_slot, hits
        )
        if num_to_allocate > self.block_pool.get_num_free_blocks():
            return None
        if self.enable_caching:
            for group_hits in hits:
                self.block_pool.touch(group_hits)
        else:
            assert not any(hits), "prefix hits while prefix caching is off"
        self.coordinator.save_new_computed_blocks(request_id, hits)
        new_blocks = self.coordinator.allocate_new_blocks(request_id, num_tokens_need_slot)
        if self.enable_caching and request.writes_prefix_cache and not delay_cache_blocks:
            # Only tokens whose KV exists after this step; lookahead slots stay unhashed.
            self.coordinator.cache_blocks(
                request, min(num_computed_tokens + num_new_tokens, request.num_tokens)
            )
        return KVCacheBlocks(new_blocks)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Caches blocks whose caching allocate_slots delayed (KV now arrived)."""
        if self.enable_caching and request.writes_prefix_cache:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def free(self, request: Request) -> None:
        self.coordinator.free(request.request_id)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def get_num_common_prefix_blocks(self, running_request_id: str) -> tuple[int, ...]:
        return self.coordinator.get_num_common_prefix_blocks(running_request_id)

    def reset_prefix_cache(self) -> bool:
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    def request_census(self) -> dict[str, int]:
        return self.coordinator.request_census()

    def check_integrity(self) -> None:
        """Raises AssertionError if the pool or the block tables break an invariant (tests)."""
        self.coordinator.check_integrity()
