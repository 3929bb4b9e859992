"""Coordinator selection and the full-attention manager's bookkeeping."""

from __future__ import annotations

from collections.abc import Callable

from kvserve.core.block_pool import BlockPool
from kvserve.core.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
    get_kv_cache_coordinator,
)
from kvserve.core.request import Request
from kvserve.core.single_type_kv_cache_manager import FullAttentionManager
from kvserve.protocol.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

MakeRequest = Callable[..., Request]
SPEC = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8)


def config(*specs: FullAttentionSpec, num_blocks: int = 10) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"layers.{i}.attn"], s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks, groups)


def test_coordinator_choice() -> None:
    assert isinstance(get_kv_cache_coordinator(config(SPEC), 64, True), UnitaryKVCacheCoordinator)
    no_cache = get_kv_cache_coordinator(config(SPEC), 64, False)
    assert isinstance(no_cache, KVCacheCoordinatorNoPrefixCache)
    other = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8)
    hybrid = get_kv_cache_coordinator(config(SPEC, other), 64, True)
    assert isinstance(hybrid, HybridKVCacheCoordinator)


def test_manager_allocates_caches_and_frees_in_reverse(make_request: MakeRequest) -> None:
    pool = BlockPool(10, enable_caching=True)
    manager = FullAttentionManager(SPEC, pool, 0, enable_caching=True)
    request = make_request(list(range(10)))
    assert manager.get_num_blocks_to_allocate(request.request_id, 10, []) == 3
    manager.save_new_computed_blocks(request.request_id, [])
    new = manager.allocate_new_blocks(request.request_id, 10)
    assert [b.block_id for b in new] == [1, 2, 3]
    assert manager.allocate_new_blocks(request.request_id, 12) == []  # still 3 blocks
    manager.cache_blocks(request, 10)
    assert manager.num_cached_block[request.request_id] == 2
    manager.free(request.request_id)
    free = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    assert free[-3:] == [3, 2, 1]
    assert request.request_id not in manager.req_to_blocks
    assert request.request_id not in manager.num_cached_block
    pool.check_integrity()


def test_longest_hit_stops_at_the_first_miss(make_request: MakeRequest) -> None:
    pool = BlockPool(10, enable_caching=True)
    first = make_request(list(range(12)))
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(first, blocks, 0, 3, 4, 0)
    # Evict block 1 of the chain: block 2 is still cached, but cannot be reached.
    pool.free_blocks([blocks[1]])
    pool.get_new_blocks(pool.get_num_free_blocks())
    hits = FullAttentionManager.find_longest_cache_hit(
        first.block_hashes, 12, [0], pool, SPEC, first
    )
    assert hits == ([blocks[0]],)
    capped = FullAttentionManager.find_longest_cache_hit(first.block_hashes, 3, [0], pool, SPEC)
    assert capped == ([],)
