"""Block hashing and the free-block queue."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest

from kvserve.core import kv_cache_utils
from kvserve.core.kv_cache_utils import (
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    compute_none_hash,
    get_block_hash,
    get_group_id,
    hash_block_tokens,
    init_none_hash,
    make_block_hash_with_group_id,
)
from kvserve.core.request import Request

MakeRequest = Callable[..., Request]


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


# --- FreeKVCacheBlockQueue ---------------------------------------------------------


def test_free_queue_keeps_order_and_counts() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.num_free_blocks == 5
    assert ids(queue.get_all_free_blocks()) == [0, 1, 2, 3, 4]
    assert queue.popleft().block_id == 0
    assert ids(queue.popleft_n(2)) == [1, 2]
    assert queue.num_free_blocks == 2
    queue.append(blocks[0])
    assert ids(queue.get_all_free_blocks()) == [3, 4, 0]


def test_free_queue_remove_from_middle_relinks_neighbours() -> None:
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    assert blocks[1].next_free_block is blocks[3] and blocks[3].prev_free_block is blocks[1]
    assert ids(queue.get_all_free_blocks()) == [0, 1, 3]
    assert queue.num_free_blocks == 3
    with pytest.raises(RuntimeError):
        queue.remove(blocks[2])  # not in the queue any more


def test_free_queue_popleft_n_and_append_n() -> None:
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks)
    taken = queue.popleft_n(4)
    assert ids(taken) == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        queue.popleft_n(3)
    assert queue.num_free_blocks == 2  # a refused popleft_n takes nothing
    queue.append_n(reversed(taken))
    assert ids(queue.get_all_free_blocks()) == [4, 5, 3, 2, 1, 0]
    assert ids(queue.popleft_n(0)) == []
    queue.popleft_n(6)
    with pytest.raises(ValueError):
        queue.popleft()


# --- hashing -------------------------------------------------------------------------


def test_block_hash_with_group_id_round_trips() -> None:
    block_hash = hash_block_tokens(None, [1, 2, 3])
    assert len(block_hash) == 32
    key = make_block_hash_with_group_id(block_hash, 258)
    assert len(key) == 36 and key[-4:] == (258).to_bytes(4, "big")
    assert get_block_hash(key) == block_hash and get_group_id(key) == 258


def test_hash_is_deterministic_and_chained() -> None:
    root = compute_none_hash(0)
    h0 = hash_block_tokens(root, [1, 2, 3, 4])
    assert h0 == hash_block_tokens(root, (1, 2, 3, 4))
    assert h0 != hash_block_tokens(root, [1, 2, 3, 5])
    assert h0 != hash_block_tokens(root, [1, 2, 3, 4], ("salt",))
    assert hash_block_tokens(h0, [5]) != hash_block_tokens(root, [5])


def test_none_hash_follows_the_seed() -> None:
    assert compute_none_hash(0) != compute_none_hash(1)
    saved = kv_cache_utils.NONE_HASH
    try:
        assert init_none_hash(7) == compute_none_hash(7)
        assert hash_block_tokens(None, [1]) == hash_block_tokens(compute_none_hash(7), [1])
    finally:
        kv_cache_utils.NONE_HASH = saved


def test_request_hasher_hashes_full_blocks_incrementally(make_request: MakeRequest) -> None:
    request = make_request(list(range(10)))  # block size 4: two full blocks
    root = compute_none_hash(0)
    h0 = hash_block_tokens(root, [0, 1, 2, 3])
    h1 = hash_block_tokens(h0, [4, 5, 6, 7])
    assert request.block_hashes == [h0, h1]
    request.append_output_token_ids([10])
    assert len(request.block_hashes) == 2  # 11 tokens: block 2 is not full yet
    request.append_output_token_ids(11)
    assert request.block_hashes[2] == hash_block_tokens(h1, [8, 9, 10, 11])


def test_changing_block_zero_changes_every_later_hash(make_request: MakeRequest) -> None:
    a = make_request(list(range(16)))
    b = make_request([99, *range(1, 16)])
    assert all(x != y for x, y in zip(a.block_hashes, b.block_hashes, strict=True))
    c = make_request([*range(15), 99])  # only the last block differs
    assert a.block_hashes[:3] == c.block_hashes[:3] and a.block_hashes[3] != c.block_hashes[3]


def test_cache_salt_enters_the_first_block(make_request: MakeRequest) -> None:
    plain = make_request(list(range(8)))
    salted = make_request(list(range(8)), cache_salt="tenant-a")
    other = make_request(list(range(8)), cache_salt="tenant-b")
    assert salted.block_hashes[0] != plain.block_hashes[0]
    assert salted.block_hashes[0] != other.block_hashes[0]
    # Later blocks differ only through the chain: their own extra keys are empty.
    assert salted.block_hashes[1] == hash_block_tokens(salted.block_hashes[0], [4, 5, 6, 7])


def test_different_seed_changes_every_hash(make_request: MakeRequest) -> None:
    a = make_request(list(range(8)), seed=0)
    b = make_request(list(range(8)), seed=1)
    assert all(x != y for x, y in zip(a.block_hashes, b.block_hashes, strict=True))


def test_hashes_agree_across_processes(make_request: MakeRequest) -> None:
    request = make_request(list(range(12)), seed=1234, cache_salt="s")
    code = (
        "from kvserve.core.kv_cache_utils import get_request_block_hasher\n"
        "from kvserve.core.request import Request\n"
        "from kvserve.sampling_params import SamplingParams\n"
        "r = Request('x', list(range(12)), SamplingParams(), 2, cache_salt='s',\n"
        "            block_hasher=get_request_block_hasher(4, 1234))\n"
        "print(','.join(h.hex() for h in r.block_hashes))\n"
    )
    # A different PYTHONHASHSEED proves Python's salted hash() plays no part.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.strip() == ",".join(h.hex() for h in request.block_hashes)


def test_hasher_is_independent_of_the_global_none_hash(make_request: MakeRequest) -> None:
    before = make_request(list(range(8))).block_hashes
    saved = kv_cache_utils.NONE_HASH
    try:
        init_none_hash(99)
        assert make_request(list(range(8))).block_hashes == before
    finally:
        kv_cache_utils.NONE_HASH = saved
