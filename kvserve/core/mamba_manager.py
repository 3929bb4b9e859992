"""The manager of Mamba groups (vLLM's MambaManager): a request's KV in such a group is
its recurrent state (the conv1d's last inputs and the SSM state), one block of the pool
every group shares, overwritten in place step after step, so its memory does not grow
with the request.

Without prefix caching a request holds exactly that one block.

With prefix caching ("align" mode), the table is aligned with the token blocks like
attention's: entry ``i``, where it is a block, is the state after the first
``(i + 1) * block_size`` tokens, and the live state (after the last computed token) is
the entry of the block that token falls in. A step gets a block for its live entry and
for the entry before it: the state at the last block end the step crosses, which the
worker stores by stopping the scan there (and at the end of the block it read from,
whose entry would otherwise hold a state from inside its block). Entries a step skips
over stay null (a chunk of a prompt caches the state at its last full block, as vLLM's
align mode). Every full
entry that is a block is then the state at its block's end: a cache entry, hashed like
an attention block. A request whose prompt starts with a cached entry's tokens resumes
from that state and computes only the rest. Entries behind the live one are freed
(null placeholders) once hashed: freed, a cache entry stays a hit until the pool
evicts it. A request holds at most 5 blocks (MambaSpec.max_num_blocks).

An entry is hashed only once the step that wrote it has run (``cache_blocks`` counts
the request's computed tokens, not the scheduled ones): a request hitting a block in
the same step as its writer would read the state before it is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvserve.core.block_pool import BlockPool, require_integrity
from kvserve.core.kv_cache_utils import BlockHash, KVCacheBlock, get_block_content
from kvserve.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from kvserve.protocol.kv_cache_interface import KVCacheSpec, MambaSpec, cdiv

if TYPE_CHECKING:
    from kvserve.core.request import Request


class MambaManager(SingleTypeKVCacheManager):
    """One state block per request (the live one), plus, with prefix caching, the
    block-end states on their way to the cache."""

    # Its table says nothing about how many tokens have KV slots (scheduler_checks).
    tracks_token_slots = False

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        enable_caching: bool,
    ) -> None:
        if not isinstance(kv_cache_spec, MambaSpec):
            raise TypeError("MambaManager needs a MambaSpec")
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id, enable_caching)
        # Align mode: the entries before this index are null already (freed or skipped).
        self.num_freed: dict[str, int] = {}

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        if not self.enable_caching:
            return 0 if self.req_to_blocks.get(request_id) else 1
        num_held = max(len(self.req_to_blocks.get(request_id, ())), len(new_computed_blocks))
        num_entries = cdiv(num_tokens, self.block_size)
        num_new = max(num_entries - max(num_held, num_entries - 2), 0)
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return num_new + num_evictable_hits

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.setdefault(request_id, [])
        if not self.enable_caching:
            if blocks:
                return []  # the state is updated in place: one block whatever the length
            blocks.extend(self.block_pool.get_new_blocks(1))
            return list(blocks)
        # Entries up to num_tokens' block: blocks for the last two (the live state and
        # the last block end the step crosses), null for those the step skips over.
        # The nulls are returned too: the worker's table must stay aligned with tokens.
        num_entries = cdiv(num_tokens, self.block_size)
        first_real = max(len(blocks), num_entries - 2)
        new_blocks = [self.block_pool.null_block] * (first_real - len(blocks))
        new_blocks += self.block_pool.get_new_blocks(max(num_entries - first_real, 0))
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Hashes the entries full within the tokens already computed (their states are
        written); the ones this step fills wait for the next call."""
        super().cache_blocks(request, min(num_tokens, request.num_computed_tokens))

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        # Every entry before the live state's (the block of the last computed token).
        return max(num_computed_tokens - 1, 0)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Frees the entries behind the live one, except those not hashed yet (their
        block-end states become cache entries at the next cache_blocks). Nulls sit
        between blocks here, so every entry in range is looked at."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks or not self.enable_caching:
            return
        num_skipped = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        end = min(num_skipped, self.num_cached_block.get(request_id, 0))
        start = self.num_freed.get(request_id, 0)
        if end <= start:
            return
        removed = [b for b in blocks[start:end] if not b.is_null]
        blocks[start:end] = [self.block_pool.null_block] * (end - start)
        self.num_freed[request_id] = end
        self.block_pool.free_blocks(reversed(removed))

    def free(self, request_id: str) -> None:
        self.num_freed.pop(request_id, None)
        super().free(request_id)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        return 0  # states are per request: nothing is shared (no cascade attention)

    def request_census(self) -> dict[str, int]:
        return {**super().request_census(), "num_freed": len(self.num_freed)}

    def check_integrity(self) -> None:
        require_integrity(
            set(self.num_freed) <= set(self.req_to_blocks), "a num_freed entry without a table"
        )
        for request_id, blocks in self.req_to_blocks.items():
            live = [b for b in blocks if not b.is_null]
            require_integrity(
                bool(blocks) and not blocks[-1].is_null,
                f"{request_id} has no live state block in Mamba group {self.kv_cache_group_id}",
            )
            # One-block mode: exactly the state; align mode: MambaSpec.max_num_blocks.
            most = 5 if self.enable_caching else 1
            require_integrity(
                1 <= len(live) <= most,
                f"{request_id} holds {len(live)} blocks in Mamba group "
                f"{self.kv_cache_group_id} (at most {most})",
            )

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
        """The last cached block-end state within max_length: one cached block, the
        entries before it null (only the state at the hit's end is read)."""
        block_size = kv_cache_spec.block_size
        num_blocks = min(max_length // block_size, len(block_hashes))
        for index in range(num_blocks - 1, -1, -1):
            content = get_block_content(request, index, block_size) if request else None
            cached = block_pool.get_cached_block(block_hashes[index], kv_cache_group_ids, content)
            if cached is not None:
                null = block_pool.null_block
                return tuple([null] * index + [block] for block in cached)
        return tuple([] for _ in kv_cache_group_ids)
