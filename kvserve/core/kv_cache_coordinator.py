"""Coordinates the per-group managers that share one BlockPool."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvserve.core.block_pool import BlockPool, require_integrity
from kvserve.core.kv_cache_utils import BlockHash, KVCacheBlock
from kvserve.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from kvserve.core.windowed_kv_cache_managers import get_manager_for_kv_cache_spec
from kvserve.protocol.kv_cache_interface import KVCacheConfig, KVCacheSpec

if TYPE_CHECKING:
    from kvserve.core.request import Request

GroupedBlocks = tuple[Sequence[KVCacheBlock], ...]


class KVCacheCoordinator(ABC):
    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool,
        enable_kv_cache_events: bool = False,
    ) -> None:
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(
            kv_cache_config.num_blocks, enable_caching, enable_kv_cache_events
        )
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(
                group.kv_cache_spec, self.block_pool, group_id, enable_caching
            )
            for group_id, group in enumerate(kv_cache_config.kv_cache_groups)
        )

    @property
    def num_groups(self) -> int:
        return len(self.single_type_managers)

    def note_request(self, request: Request) -> None:
        for manager in self.single_type_managers:
            manager.note_request(request)

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: GroupedBlocks
    ) -> int:
        return sum(
            manager.get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks[i])
            for i, manager in enumerate(self.single_type_managers)
        )

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: GroupedBlocks) -> None:
        for i, manager in enumerate(self.single_type_managers):
            manager.save_new_computed_blocks(request_id, new_computed_blocks[i])

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int
    ) -> tuple[list[KVCacheBlock], ...]:
        return tuple(
            m.allocate_new_blocks(request_id, num_tokens) for m in self.single_type_managers
        )

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.cache_blocks(request, num_computed_tokens)

    def free(self, request_id: str) -> None:
        for manager in self.single_type_managers:
            manager.free(request_id)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> tuple[int, ...]:
        return tuple(
            m.get_num_common_prefix_blocks(running_request_id) for m in self.single_type_managers
        )

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(list(m.req_to_blocks.get(request_id, ())) for m in self.single_type_managers)

    def request_census(self) -> dict[str, int]:
        return {
            f"group_{m.kv_cache_group_id}.{key}": n
            for m in self.single_type_managers
            for key, n in m.request_census().items()
        }

    def check_integrity(self) -> None:
        """Raises AssertionError if the managers and the pool disagree (for tests, debug).

        Checks the pool's own invariants, then that each block's ref_cnt equals the number
        of request tables that hold it, that a request holds a block at most once, that the
        null block is held only as a placeholder, and that cached-prefix counts fit.
        """
        self.block_pool.check_integrity()
        holders: dict[int, int] = {}
        for manager in self.single_type_managers:
            manager.check_integrity()
            require_integrity(
                set(manager.num_cached_block) <= set(manager.req_to_blocks),
                "a num_cached_block entry without a block table",
            )
            for request_id, blocks in manager.req_to_blocks.items():
                ids = [b.block_id for b in blocks if not b.is_null]
                require_integrity(len(ids) == len(set(ids)), f"{request_id} holds a block twice")
                require_integrity(
                    manager.num_cached_block.get(request_id, 0) <= len(blocks),
                    f"{request_id} has more cached blocks than blocks",
                )
                for block_id in ids:
                    holders[block_id] = holders.get(block_id, 0) + 1
        for block in self.block_pool.blocks:
            if block.is_null:
                continue
            require_integrity(
                block.ref_cnt == holders.get(block.block_id, 0),
                f"{block} has ref_cnt {block.ref_cnt} but {holders.get(block.block_id, 0)} "
                "request tables hold it",
            )
        num_used = self.block_pool.num_blocks - 1 - self.block_pool.get_num_free_blocks()
        require_integrity(num_used == len(holders), "free + used != total blocks")
        if not self.enable_caching:
            require_integrity(
                not self.block_pool.cached_block_hash_to_block, "hashed blocks with caching off"
            )

    @abstractmethod
    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_cache_hit_length: int,
        request: Request | None = None,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """(hit blocks per group, number of hit tokens)."""


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching off: never a hit, blocks are never hashed."""

    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_cache_hit_length: int,
        request: Request | None = None,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        return tuple([] for _ in range(self.num_groups)), 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """Exactly one KV cache group: its manager's hit is the answer."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool,
        enable_kv_cache_events: bool = False,
    ) -> None:
        super().__init__(kv_cache_config, max_model_len, enable_caching, enable_kv_cache_events)
        assert self.num_groups == 1
        self.kv_cache_spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.block_size = self.kv_cache_spec.block_size

    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_cache_hit_length: int,
        request: Request | None = None,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        hits = type(self.single_type_managers[0]).find_longest_cache_hit(
            block_hashes, max_cache_hit_length, [0], self.block_pool, self.kv_cache_spec, request
        )
        return hits, len(hits[0]) * self.block_size


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several groups of different attention types over one pool (e.g. Gemma 3's sliding
    window and global layers).

    Groups with equal specs are looked up together (one hash probe per block serves all of
    them). A prefix hit must be served by every group, so the lengths are reconciled: full
    attention left to right first, which bounds the rest; every other type then searches
    within that bound (a window right to left), and the smallest length wins. A shorter
    length may change another type's answer (a window's run ends elsewhere), so the search
    repeats until a round shrinks nothing; lengths only shrink, so it ends.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool,
        enable_kv_cache_events: bool = False,
    ) -> None:
        super().__init__(kv_cache_config, max_model_len, enable_caching, enable_kv_cache_events)
        by_spec: dict[KVCacheSpec, list[int]] = {}
        for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
            by_spec.setdefault(group.kv_cache_spec, []).append(group_id)
        # Full attention first: its answer is the upper bound for the others.
        self.attention_groups: list[tuple[KVCacheSpec, list[int]]] = sorted(
            by_spec.items(), key=lambda item: not item[0].attends_to_all
        )
        block_sizes = {spec.block_size for spec in by_spec}
        if len(block_sizes) != 1:
            raise ValueError(f"KV cache groups with different block sizes {sorted(block_sizes)}")
        self.block_size = block_sizes.pop()

    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_cache_hit_length: int,
        request: Request | None = None,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        hit_length = max_cache_hit_length // self.block_size * self.block_size
        hits: dict[int, list[KVCacheBlock]] = {}
        shrunk = True
        while shrunk:  # a round where every type answers hit_length is consistent
            shrunk = False
            for spec, group_ids in self.attention_groups:
                manager_cls = type(self.single_type_managers[group_ids[0]])
                found = manager_cls.find_longest_cache_hit(
                    block_hashes, hit_length, group_ids, self.block_pool, spec, request
                )
                for group_id, blocks in zip(group_ids, found, strict=True):
                    hits[group_id] = blocks
                length = len(found[0]) * self.block_size
                if length < hit_length:
                    hit_length, shrunk = length, True
        num_blocks = hit_length // self.block_size
        return tuple(hits[g][:num_blocks] for g in range(self.num_groups)), hit_length


def get_kv_cache_coordinator(
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    enable_caching: bool,
    enable_kv_cache_events: bool = False,
) -> KVCacheCoordinator:
    if not enable_caching:
        return KVCacheCoordinatorNoPrefixCache(
            kv_cache_config, max_model_len, enable_caching, enable_kv_cache_events
        )
    if len(kv_cache_config.kv_cache_groups) == 1:
        return UnitaryKVCacheCoordinator(
            kv_cache_config, max_model_len, enable_caching, enable_kv_cache_events
        )
    return HybridKVCacheCoordinator(
        kv_cache_config, max_model_len, enable_caching, enable_kv_cache_events
    )
