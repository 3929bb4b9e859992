"""KVCacheManager: prefix hits, allocation, caching of computed blocks, freeing."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvserve.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvserve.core.request import Request
from kvserve.protocol.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

MakeRequest = Callable[..., Request]
BS = 4


def make_manager(num_blocks: int, **kwargs: object) -> KVCacheManager:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8)
    config = KVCacheConfig(num_blocks, [KVCacheGroupSpec(["layers.0.attn"], spec)])
    kwargs.setdefault("log_stats", True)
    return KVCacheManager(config, max_model_len=64, **kwargs)  # type: ignore[arg-type]


def run_prefill(manager: KVCacheManager, request: Request) -> tuple[int, KVCacheBlocks]:
    """Schedules the whole prompt at once, as the scheduler would; returns the hit tokens."""
    hits, num_hit = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hits)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    manager.block_pool.check_integrity()
    return num_hit, new


def test_prefix_hit_counts_whole_blocks_and_stats(make_request: MakeRequest) -> None:
    manager = make_manager(16)
    first = make_request(list(range(10)))
    assert run_prefill(manager, first)[0] == 0
    second = make_request([*range(8), 50, 51, 52])
    num_hit, new = run_prefill(manager, second)
    assert num_hit == 8
    first_ids = manager.get_block_ids(first.request_id)[0]
    second_ids = manager.get_block_ids(second.request_id)[0]
    assert second_ids[:2] == first_ids[:2] and second_ids[2] not in first_ids
    assert new.get_block_ids() == ([second_ids[2]],)  # only the fresh block is "new"
    stats = manager.make_prefix_cache_stats()
    assert stats is not None and (stats.requests, stats.queries, stats.hits) == (2, 21, 8)
    after = manager.make_prefix_cache_stats()
    assert after is not None and (after.requests, after.queries, after.hits) == (0, 0, 0)
    assert manager.get_num_common_prefix_blocks(first.request_id) == (2,)
    manager.free(first)
    manager.free(second)
    assert manager.block_pool.get_num_free_blocks() == 15


def test_fully_cached_prompt_recomputes_its_last_token(make_request: MakeRequest) -> None:
    manager = make_manager(16)
    first = make_request(list(range(8)))
    run_prefill(manager, first)
    manager.free(first)
    again = make_request(list(range(8)))
    blocks, num_hit = manager.get_computed_blocks(again)
    # 8 cached tokens, but at most 7 may be reused: one whole block.
    assert num_hit == 4 and len(blocks.blocks[0]) == 1
    longer = make_request(list(range(9)))
    assert manager.get_computed_blocks(longer)[1] == 8


def test_no_hits_when_caching_is_off_or_prompt_logprobs(make_request: MakeRequest) -> None:
    manager = make_manager(16)
    run_prefill(manager, make_request(list(range(9))))
    wants_logprobs = make_request(list(range(9)), prompt_logprobs=1)
    assert manager.get_computed_blocks(wants_logprobs)[1] == 0
    off = make_manager(16, enable_caching=False)
    run_prefill(off, make_request(list(range(9))))
    assert off.get_computed_blocks(make_request(list(range(9))))[1] == 0
    assert off.block_pool.cached_block_hash_to_block == {}


def test_failed_allocation_changes_nothing(make_request: MakeRequest) -> None:
    manager = make_manager(5)  # 4 usable blocks
    cached = make_request(list(range(8)))
    run_prefill(manager, cached)
    manager.free(cached)  # 2 cached free blocks, 4 free in all
    big = make_request([*range(8), *range(60, 69)])  # 17 tokens: 5 blocks, 2 of them hits
    hits, num_hit = manager.get_computed_blocks(big)
    assert num_hit == 8
    assert manager.allocate_slots(big, big.num_tokens - num_hit, num_hit, hits) is None
    assert manager.block_pool.get_num_free_blocks() == 4
    assert all(b.ref_cnt == 0 for b in hits.blocks[0])
    assert manager.get_block_ids(big.request_id) == ([],)
    manager.block_pool.check_integrity()


def test_free_cached_hits_count_against_free_blocks(make_request: MakeRequest) -> None:
    manager = make_manager(5)  # 4 usable blocks
    cached = make_request(list(range(8)))
    run_prefill(manager, cached)
    manager.free(cached)
    # 2 hits (free, so they use up 2 free blocks) + 2 new blocks = exactly 4.
    fits = make_request([*range(8), *range(60, 68)])
    num_hit, _ = run_prefill(manager, fits)
    assert num_hit == 8 and manager.block_pool.get_num_free_blocks() == 0
    manager.free(fits)
    assert manager.block_pool.get_num_free_blocks() == 4
    manager.block_pool.check_integrity()


def test_only_computed_full_blocks_are_cached(make_request: MakeRequest) -> None:
    manager = make_manager(16)
    request = make_request(list(range(12)))
    # A 6-token chunk plus 4 lookahead slots: 3 blocks, only block 0 full of computed KV.
    new = manager.allocate_slots(request, 6, num_lookahead_tokens=4)
    assert new is not None and len(new.blocks[0]) == 3
    assert [b.block_hash is not None for b in new.blocks[0]] == [True, False, False]
    request.num_computed_tokens = 6
    assert manager.allocate_slots(request, 6) is not None
    blocks = manager.get_blocks(request.request_id).blocks[0]
    assert [b.block_hash is not None for b in blocks] == [True, True, True]
    manager.free(request)
    manager.block_pool.check_integrity()


def test_delayed_caching(make_request: MakeRequest) -> None:
    manager = make_manager(16)
    request = make_request(list(range(8)))
    assert manager.allocate_slots(request, 8, delay_cache_blocks=True) is not None
    assert manager.block_pool.cached_block_hash_to_block == {}
    manager.cache_blocks(request, 8)
    assert len(manager.block_pool.cached_block_hash_to_block) == 2
    manager.free(request)
    manager.block_pool.check_integrity()


def test_forced_hash_collision_is_a_miss(make_request: MakeRequest) -> None:
    manager = make_manager(16)
    original = make_request(list(range(9)))
    run_prefill(manager, original)
    impostor = make_request(list(range(50, 59)))
    impostor.block_hashes[:] = original.block_hashes  # same keys, other tokens
    assert manager.get_computed_blocks(impostor)[1] == 0
    twin = make_request(list(range(9)))
    assert manager.get_computed_blocks(twin)[1] == 8


def test_reset_prefix_cache_and_usage(make_request: MakeRequest) -> None:
    manager = make_manager(9)
    request = make_request(list(range(8)))
    run_prefill(manager, request)
    assert manager.usage == pytest.approx(2 / 8)
    assert not manager.reset_prefix_cache()
    manager.free(request)
    assert manager.usage == 0.0
    assert manager.reset_prefix_cache()
    stats = manager.make_prefix_cache_stats()
    assert stats is not None and stats.reset
    assert manager.get_computed_blocks(make_request(list(range(9))))[1] == 0


def test_kv_cache_blocks_add_and_ids() -> None:
    manager = make_manager(8)
    blocks = manager.block_pool.get_new_blocks(3)
    a, b = KVCacheBlocks((blocks[:2],)), KVCacheBlocks((blocks[2:],))
    assert (a + b).get_block_ids() == ([1, 2, 3],)
    assert manager.empty_kv_cache_blocks.get_block_ids() == ([],)
    assert (manager.empty_kv_cache_blocks + a).get_block_ids() == ([1, 2],)
    assert manager.empty_kv_cache_blocks.is_empty() and not a.is_empty()


def test_events_flow_through_the_manager(make_request: MakeRequest) -> None:
    manager = make_manager(8, enable_kv_cache_events=True)
    run_prefill(manager, make_request(list(range(8))))
    events = manager.take_events()
    assert len(events) == 1 and manager.take_events() == []
