"""Block hashes, the KV cache block, and the free-block queue of the paged KV cache.

Block hashes are the prefix cache's keys and must agree across processes and machines
(two engines sharing a KV tier, a router following KV events), so they are SHA-256
digests of a canonical msgpack encoding, never Python's salted hash():

    hash(block i) = sha256(msgpack([hash(block i-1), token_ids of block i, extra_keys]))

The chain's root, hash(block -1), is NONE_HASH = sha256(b"kvserve.none_hash" +
seed as 8 big-endian bytes), where the seed is CacheConfig.prefix_caching_hash_seed.
Every process that uses the same seed computes the same keys for the same tokens.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, NewType

import msgspec

if TYPE_CHECKING:
    from kvserve.core.request import Request

# 32-byte SHA-256 digest of one full block, chained from its parent.
BlockHash = NewType("BlockHash", bytes)
# BlockHash + 4-byte big-endian KV cache group id: the key of the prefix-cache map.
BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)

_GROUP_ID_BYTES = 4
# order="deterministic" sorts map keys, so equal values always encode to equal bytes.
_encoder = msgspec.msgpack.Encoder(order="deterministic")


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(_GROUP_ID_BYTES, "big"))


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    return BlockHash(key[:-_GROUP_ID_BYTES])


def get_group_id(key: BlockHashWithGroupId) -> int:
    return int.from_bytes(key[-_GROUP_ID_BYTES:], "big")


def compute_none_hash(seed: int) -> BlockHash:
    """The root of every hash chain for this seed (see the module docstring)."""
    return BlockHash(hashlib.sha256(b"kvserve.none_hash" + seed.to_bytes(8, "big")).digest())


NONE_HASH: BlockHash = compute_none_hash(0)


def init_none_hash(seed: int) -> BlockHash:
    """Sets the process-wide root used when hash_block_tokens gets no parent."""
    global NONE_HASH
    NONE_HASH = compute_none_hash(seed)
    return NONE_HASH


def hash_block_tokens(
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """SHA-256 of [parent, tokens, extra_keys]; a None parent means NONE_HASH."""
    parent = NONE_HASH if parent_block_hash is None else parent_block_hash
    payload = _encoder.encode((parent, list(curr_block_token_ids), extra_keys))
    return BlockHash(hashlib.sha256(payload).digest())


def generate_block_hash_extra_keys(
    request: Request, block_index: int, block_size: int = 0
) -> tuple[Any, ...] | None:
    """What besides the tokens decides a block's KV.

    The cache salt only needs to enter the first block: every later hash chains from it.
    The LoRA adapter's id enters every block, as in vLLM: the same tokens through another
    adapter are other keys and values, so adapters never share blocks. Each multimodal
    item a block overlaps enters as its content hash and its offset from the block's
    start: the placeholder tokens of two images are equal, their KV is not.
    """
    keys: list[Any] = []
    if block_index == 0 and request.cache_salt:
        keys.append(request.cache_salt)
    lora = request.lora_request
    if lora is not None:
        keys.append(("lora", lora.lora_int_id))
    if request.mm_features:
        assert block_size > 0, "multimodal block keys need the block size"
        start = block_index * block_size
        for feature in request.mm_features:
            if feature.mm_position.overlaps(start, start + block_size):
                keys.append((feature.identifier, feature.mm_position.offset - start))
    return tuple(keys) if keys else None


class BlockContent(NamedTuple):
    """What one block's hash was computed from, kept on cached blocks to catch collisions.

    The parent is None for block 0 so the content does not depend on the seed.
    """

    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    extra_keys: tuple[Any, ...] | None


def get_block_content(request: Request, block_index: int, block_size: int) -> BlockContent:
    start = block_index * block_size
    parent = request.block_hashes[block_index - 1] if block_index > 0 else None
    return BlockContent(
        parent,
        tuple(request.all_token_ids[start : start + block_size]),
        generate_block_hash_extra_keys(request, block_index, block_size),
    )


def get_request_block_hasher(block_size: int, seed: int) -> Callable[[Request], list[BlockHash]]:
    """Returns the function that hashes a request's full blocks not hashed yet."""
    root = compute_none_hash(seed)

    def request_block_hasher(request: Request) -> list[BlockHash]:
        index = len(request.block_hashes)
        parent = request.block_hashes[-1] if index else root
        token_ids = request.all_token_ids
        new_hashes: list[BlockHash] = []
        while (index + 1) * block_size <= len(token_ids):
            block = token_ids[index * block_size : (index + 1) * block_size]
            parent = hash_block_tokens(
                parent, block, generate_block_hash_extra_keys(request, index, block_size)
            )
            new_hashes.append(parent)
            index += 1
        return new_hashes

    return request_block_hasher


class KVCacheBlock:
    """One block of the paged KV cache, also a node of FreeKVCacheBlockQueue."""

    __slots__ = (
        "_block_hash",
        "block_id",
        "content",
        "is_null",
        "next_free_block",
        "prev_free_block",
        "ref_cnt",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block is a prefix-cache entry (full and hashed).
        self._block_hash: BlockHashWithGroupId | None = None
        self.content: BlockContent | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHashWithGroupId) -> None:
        assert self._block_hash is None, f"block {self.block_id} already has a hash"
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        self._block_hash = None
        self.content = None

    def __repr__(self) -> str:
        hash_hex = self._block_hash.hex()[:12] if self._block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={hash_hex})"


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order (head = least recently freed), as an intrusive list.

    The links live in the blocks themselves, so removing a block from the middle (a
    prefix-cache hit on a free block) is O(1). Fake head and tail nodes remove the
    edge cases from every operation.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(-1)
        self.fake_free_list_tail = KVCacheBlock(-1)
        chain = [self.fake_free_list_head, *blocks, self.fake_free_list_tail]
        for prev, nxt in itertools.pairwise(chain):
            prev.next_free_block = nxt
            nxt.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        block = self.fake_free_list_head.next_free_block
        if block is None or block is self.fake_free_list_tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} left")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() of {block}, which is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = tail
        tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        out: list[KVCacheBlock] = []
        block = self.fake_free_list_head.next_free_block
        while block is not None and block is not self.fake_free_list_tail:
            out.append(block)
            block = block.next_free_block
        return out
