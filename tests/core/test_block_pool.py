"""BlockPool: LRU eviction, reference counts, the prefix-cache map and KV events."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest

from kvserve.core.block_pool import BlockPool
from kvserve.core.kv_cache_utils import KVCacheBlock, get_block_content
from kvserve.core.request import Request
from kvserve.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

MakeRequest = Callable[..., Request]
BS = 4


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def free_ids(pool: BlockPool) -> list[int]:
    return ids(pool.free_block_queue.get_all_free_blocks())


def cache_request(pool: BlockPool, request: Request, num_blocks: int) -> list[KVCacheBlock]:
    """Allocates and caches the request's first num_blocks full blocks."""
    blocks = pool.get_new_blocks(num_blocks)
    pool.cache_full_blocks(request, blocks, 0, num_blocks, BS, 0)
    pool.check_integrity()
    return blocks


def test_null_block_is_block_zero_and_never_free() -> None:
    pool = BlockPool(5, enable_caching=True)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4 and 0 not in free_ids(pool)
    blocks = pool.get_new_blocks(4)
    assert 0 not in ids(blocks) and pool.get_usage() == 1.0
    pool.free_blocks([pool.null_block, *blocks])  # the null block is skipped
    assert pool.get_num_free_blocks() == 4 and pool.null_block.ref_cnt == 0
    pool.check_integrity()


def test_get_new_blocks_pops_lru_and_refuses_too_many() -> None:
    pool = BlockPool(6, enable_caching=True)
    first = pool.get_new_blocks(2)
    assert ids(first) == [1, 2] and all(b.ref_cnt == 1 for b in first)
    assert pool.get_usage() == pytest.approx(0.4)
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    assert pool.get_num_free_blocks() == 3
    pool.free_blocks(first)
    pool.check_integrity()
    assert free_ids(pool) == [3, 4, 5, 1, 2]  # freed blocks go to the tail
    assert ids(pool.get_new_blocks(3)) == [3, 4, 5]
    pool.check_integrity()


def test_chain_tail_is_evicted_first_after_reverse_free(make_request: MakeRequest) -> None:
    pool = BlockPool(8, enable_caching=True)
    request = make_request(3 * BS)
    blocks = cache_request(pool, request, 3)
    pool.free_blocks(reversed(blocks))
    pool.check_integrity()
    assert free_ids(pool)[-3:] == [3, 2, 1]
    # Drain the never-used blocks, then the next allocation evicts the chain's last block.
    pool.get_new_blocks(4)
    (evicted,) = pool.get_new_blocks(1)
    assert evicted.block_id == 3 and evicted.block_hash is None
    assert pool.get_cached_block(request.block_hashes[2], [0]) is None
    assert pool.get_cached_block(request.block_hashes[0], [0]) == [blocks[0]]
    pool.check_integrity()


def test_touch_takes_a_free_cached_block_back(make_request: MakeRequest) -> None:
    pool = BlockPool(6, enable_caching=True)
    request = make_request(2 * BS)
    blocks = cache_request(pool, request, 2)
    pool.free_blocks(reversed(blocks))
    hit = pool.get_cached_block(request.block_hashes[0], [0])
    assert hit == [blocks[0]] and blocks[0].ref_cnt == 0
    pool.touch(hit)
    pool.check_integrity()
    assert blocks[0].ref_cnt == 1 and 1 not in free_ids(pool)
    pool.touch(hit)  # a second user of a block in use: only the count grows
    assert blocks[0].ref_cnt == 2 and pool.get_num_free_blocks() == 4
    pool.free_blocks(hit)
    pool.free_blocks(hit)
    pool.check_integrity()
    assert blocks[0].ref_cnt == 0 and free_ids(pool)[-1] == 1


def test_reset_prefix_cache_only_when_everything_is_free(make_request: MakeRequest) -> None:
    pool = BlockPool(6, enable_caching=True, enable_kv_cache_events=True)
    request = make_request(2 * BS)
    blocks = cache_request(pool, request, 2)
    assert not pool.reset_prefix_cache()
    assert pool.get_cached_block(request.block_hashes[0], [0]) is not None
    pool.free_blocks(reversed(blocks))
    pool.take_events()
    assert pool.reset_prefix_cache()
    pool.check_integrity()
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.take_events() == [AllBlocksCleared()]


def test_events_report_stores_and_evictions(make_request: MakeRequest) -> None:
    pool = BlockPool(4, enable_caching=True, enable_kv_cache_events=True)
    request = make_request(2 * BS + 1)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(request, blocks, 0, 1, BS, 0)
    pool.cache_full_blocks(request, blocks, 1, 2, BS, 0)
    pool.cache_full_blocks(request, blocks, 2, 2, BS, 0)  # nothing new: no event
    stored = pool.take_events()
    assert stored == [
        BlockStored([request.block_hashes[0]], None, request.all_token_ids[:BS], BS, "GPU", 0),
        BlockStored(
            [request.block_hashes[1]],
            request.block_hashes[0],
            request.all_token_ids[BS : 2 * BS],
            BS,
            "GPU",
            0,
        ),
    ]
    assert pool.take_events() == []
    pool.free_blocks(reversed(blocks))
    pool.get_new_blocks(3)  # order: block 3 (never cached), then 2, then 1
    assert pool.take_events() == [
        BlockRemoved([request.block_hashes[1]], "GPU", 0),
        BlockRemoved([request.block_hashes[0]], "GPU", 0),
    ]
    pool.check_integrity()


def test_events_are_off_by_default(make_request: MakeRequest) -> None:
    pool = BlockPool(4, enable_caching=True)
    cache_request(pool, make_request(BS), 1)
    assert pool.take_events() == []


def test_event_batch_round_trips_through_msgpack(make_request: MakeRequest) -> None:
    batch = KVEventBatch(
        ts=1.5,
        events=[
            BlockStored([b"\x01" * 32], None, [1, 2, 3, 4], 4, "GPU", group_id=2),
            BlockRemoved([b"\x02" * 32], "GPU"),
            AllBlocksCleared(),
        ],
    )
    data = msgspec.msgpack.encode(batch)
    assert msgspec.msgpack.decode(data, type=KVEventBatch) == batch


def test_same_hash_in_two_blocks_is_kept_for_both(make_request: MakeRequest) -> None:
    pool = BlockPool(6, enable_caching=True)
    a, b = make_request(BS), make_request(BS)  # the same tokens, computed twice
    block_a = cache_request(pool, a, 1)[0]
    block_b = cache_request(pool, b, 1)[0]
    entry = pool.cached_block_hash_to_block[block_a.block_hash]  # type: ignore[index]
    assert isinstance(entry, dict) and set(entry) == {block_a.block_id, block_b.block_id}
    pool.free_blocks([block_a, block_b])
    pool.get_new_blocks(3)  # the three never-used blocks
    pool.get_new_blocks(1)  # evicts block_a only
    pool.check_integrity()
    assert pool.get_cached_block(a.block_hashes[0], [0]) == [block_b]


def test_hash_collision_with_other_tokens_is_a_miss(make_request: MakeRequest) -> None:
    pool = BlockPool(4, enable_caching=True)
    cached = make_request(list(range(BS)))
    cache_request(pool, cached, 1)
    impostor = make_request(list(range(50, 50 + BS)))
    impostor.block_hashes[0] = cached.block_hashes[0]  # force a collision
    own = get_block_content(cached, 0, BS)
    assert pool.get_cached_block(cached.block_hashes[0], [0], own) is not None
    forged = get_block_content(impostor, 0, BS)
    assert pool.get_cached_block(impostor.block_hashes[0], [0], forged) is None


def test_caching_disabled_never_hashes() -> None:
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(blocks)
    assert pool.cached_block_hash_to_block == {}
    pool.check_integrity()


def test_check_integrity_catches_corruption() -> None:
    pool = BlockPool(4, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    block.ref_cnt = 0  # held by nobody but outside the free queue
    with pytest.raises(AssertionError):
        pool.check_integrity()
    block.ref_cnt = 1
    pool.check_integrity()
    pool.free_blocks([block])
    with pytest.raises(RuntimeError):
        pool.free_blocks([block])  # a double free
