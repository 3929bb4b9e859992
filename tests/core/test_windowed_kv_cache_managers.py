"""Sliding-window, chunked-local and sink managers, the hybrid coordinator and the shared
memory layout, on the pure-Python core (the model-level checks live in tests/models)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvserve.core.block_pool import BlockPool
from kvserve.core.kv_cache_coordinator import HybridKVCacheCoordinator
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_cache_utils import KVCacheBlock
from kvserve.core.request import Request
from kvserve.core.single_type_kv_cache_manager import FullAttentionManager
from kvserve.core.windowed_kv_cache_managers import (
    ChunkedLocalAttentionManager,
    SinkFullAttentionManager,
    SlidingWindowManager,
)
from kvserve.protocol.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    build_kv_cache_config,
    max_tokens_per_request,
)

MakeRequest = Callable[..., Request]
BS = 4
HEADS = {"num_kv_heads": 1, "head_size": 8}
FULL = FullAttentionSpec(block_size=BS, **HEADS)
WINDOW = SlidingWindowSpec(block_size=BS, sliding_window=8, **HEADS)


def ids(blocks: Sequence[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def run_tokens(manager: SlidingWindowManager | SinkFullAttentionManager | ChunkedLocalAttentionManager,
               request: Request, upto: int) -> None:  # fmt: skip
    """Advance a request one token at a time as the scheduler would: skip, allocate."""
    rid = request.request_id
    manager.save_new_computed_blocks(rid, [])
    for num_computed in range(upto):
        manager.remove_skipped_blocks(rid, num_computed)
        manager.allocate_new_blocks(rid, num_computed + 1)


def test_sliding_window_frees_blocks_out_of_view(make_request: MakeRequest) -> None:
    pool = BlockPool(64, enable_caching=True)
    manager = SlidingWindowManager(WINDOW, pool, 0, enable_caching=True)
    request = make_request(40)
    run_tokens(manager, request, 40)
    blocks = manager.req_to_blocks[request.request_id]
    assert len(blocks) == 10
    # The last query (position 39) sees 32..39: blocks 8 and 9 live, everything before null.
    manager.remove_skipped_blocks(request.request_id, 40)
    assert [b.is_null for b in blocks] == [True] * 8 + [False] * 2
    assert manager.num_live_blocks(request.request_id) <= -(-8 // BS) + 1
    assert pool.get_num_used_blocks() == 2
    manager.free(request.request_id)
    assert pool.get_num_used_blocks() == 0
    pool.check_integrity()


def test_sliding_window_hit_is_found_right_to_left(make_request: MakeRequest) -> None:
    pool = BlockPool(64, enable_caching=True)
    prompt = list(range(100, 124))  # 6 blocks
    first = make_request(prompt)
    blocks = pool.get_new_blocks(6)
    pool.cache_full_blocks(first, blocks, 0, 6, BS, 0)
    pool.free_blocks(blocks)
    # Evict block 1: full attention could reuse one block, the window still sees the end.
    pool._maybe_evict_cached_block(blocks[1])
    again = make_request(prompt)
    (hit,) = SlidingWindowManager.find_longest_cache_hit(
        again.block_hashes, 23, [0], pool, WINDOW, again
    )
    # Bound 23 -> 5 blocks; W-1 = 7 tokens need blocks 3 and 4; 0..2 are null.
    assert [b.is_null for b in hit] == [True, True, True, False, False]
    assert ids(hit[3:]) == ids(blocks[3:5])
    (full_hit,) = FullAttentionManager.find_longest_cache_hit(
        again.block_hashes, 23, [0], pool, FULL, again
    )
    assert ids(full_hit) == ids(blocks[:1])


def test_short_prefix_run_from_the_start_is_a_hit(make_request: MakeRequest) -> None:
    pool = BlockPool(16, enable_caching=True)
    first = make_request(list(range(100, 104)))
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(first, blocks, 0, 1, BS, 0)
    again = make_request(list(range(100, 112)))
    (hit,) = SlidingWindowManager.find_longest_cache_hit(
        again.block_hashes, 11, [0], pool, WINDOW, again
    )
    assert ids(hit) == ids(blocks)


def test_chunked_local_frees_earlier_chunks(make_request: MakeRequest) -> None:
    spec = ChunkedLocalAttentionSpec(block_size=BS, attention_chunk_size=8, **HEADS)
    pool = BlockPool(64, enable_caching=True)
    manager = ChunkedLocalAttentionManager(spec, pool, 0, enable_caching=True)
    request = make_request(30)
    run_tokens(manager, request, 30)
    manager.remove_skipped_blocks(request.request_id, 30)
    blocks = manager.req_to_blocks[request.request_id]
    # Position 30 is in chunk 24..31: blocks 0..5 are never read again.
    assert [b.is_null for b in blocks] == [True] * 6 + [False] * 2
    # A hit inside chunk 3 needs nothing from chunks 0..2.
    (hit,) = ChunkedLocalAttentionManager.find_longest_cache_hit(
        request.block_hashes, 29, [0], pool, spec, request
    )
    assert [b.is_null for b in hit] == [True] * 6
    manager.free(request.request_id)
    pool.check_integrity()


def test_sinks_stay_while_the_window_slides(make_request: MakeRequest) -> None:
    spec = SinkFullAttentionSpec(block_size=BS, sink_len=4, sliding_window=8, **HEADS)
    pool = BlockPool(64, enable_caching=True)
    manager = SinkFullAttentionManager(spec, pool, 0, enable_caching=True)
    request = make_request(40)
    run_tokens(manager, request, 40)
    manager.remove_skipped_blocks(request.request_id, 40)
    blocks = manager.req_to_blocks[request.request_id]
    assert [b.is_null for b in blocks] == [False] + [True] * 7 + [False] * 2
    manager.free(request.request_id)
    assert pool.get_num_used_blocks() == 0


def test_hybrid_hit_is_what_every_group_can_serve(make_request: MakeRequest) -> None:
    groups = [KVCacheGroupSpec(["full"], FULL), KVCacheGroupSpec(["window"], WINDOW)]
    config = KVCacheConfig(64, groups)
    manager = KVCacheManager(config, max_model_len=256, enable_caching=True)
    assert isinstance(manager.coordinator, HybridKVCacheCoordinator)
    prompt = list(range(100, 125))
    first = make_request(prompt)
    assert manager.allocate_slots(first, 25) is not None
    first.num_computed_tokens = 25
    manager.coordinator.remove_skipped_blocks(first.request_id, 25)
    manager.free(first)
    manager.check_integrity()
    second = make_request([*prompt, 7, 8, 9])
    blocks, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 24  # 6 full blocks; the window's last 7 tokens are cached too
    full_hits, window_hits = blocks.blocks
    assert len(full_hits) == len(window_hits) == 6
    assert all(b.is_null for b in window_hits[:4]) and not any(b.is_null for b in full_hits)
    assert manager.allocate_slots(second, 4, num_hit, blocks) is not None
    manager.check_integrity()
    manager.free(second)
    assert manager.num_blocks_in_use == 0
    manager.check_integrity()


def test_shared_layout_costs_one_group_of_pages_per_block() -> None:
    # Gemma 3 270M's pattern: 18 layers, every 6th global.
    specs = {
        f"layers.{i}.attn": FULL
        if (i + 1) % 6 == 0
        else SlidingWindowSpec(block_size=BS, sliding_window=512, **HEADS)
        for i in range(18)
    }
    memory = 4 << 20  # a pool well past the windows' bounded share
    config = build_kv_cache_config(specs, memory)
    assert [len(g.layer_names) for g in config.kv_cache_groups] == [3] * 6
    assert type(config.kv_cache_groups[0].kv_cache_spec) is FullAttentionSpec
    assert len(config.kv_cache_tensors) == 3
    assert all(len(t.shared_by) == 6 for t in config.kv_cache_tensors)
    assert config.bytes_per_block == 3 * FULL.page_size_bytes
    per_layer = build_kv_cache_config(dict.fromkeys(specs, FULL), memory)
    hybrid_tokens = max_tokens_per_request(config, 64)
    full_tokens = max_tokens_per_request(per_layer, 64)
    assert hybrid_tokens >= 3 * full_tokens, (hybrid_tokens, full_tokens)
