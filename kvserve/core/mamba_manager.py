"""The manager of Mamba groups (vLLM's MambaManager): a request's KV in such a group is
one block holding its whole recurrent state (the conv1d's last inputs and the SSM
state), allocated from the pool every group shares and overwritten in place by each
step, so its memory does not grow with the request.

Prefix caching: a state block is the state after the request's last computed token,
not after a block boundary, so it is never a cache entry and never a hit; a hybrid
model's hit is then empty in every group (the coordinator takes the shortest), which
keeps tokens exact. The engine says so at start-up and turns caching off.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvserve.core.block_pool import BlockPool, require_integrity
from kvserve.core.kv_cache_utils import BlockHash, KVCacheBlock
from kvserve.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from kvserve.protocol.kv_cache_interface import KVCacheSpec, MambaSpec

if TYPE_CHECKING:
    from kvserve.core.request import Request


class MambaManager(SingleTypeKVCacheManager):
    """Exactly one state block per request that holds blocks at all."""

    # Its one block says nothing about how many tokens have slots (scheduler_checks).
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

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        assert not new_computed_blocks, "a Mamba group never has prefix hits"
        return 0 if self.req_to_blocks.get(request_id) else 1

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        assert not new_computed_blocks, "a Mamba group never has prefix hits"

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        if self.req_to_blocks.get(request_id):
            return []  # the state is updated in place: one block whatever the length
        new_blocks = self.block_pool.get_new_blocks(1)
        self.req_to_blocks[request_id] = list(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Never a cache entry: the block's content changes every step."""

    def free(self, request_id: str) -> None:
        self.block_pool.free_blocks(self.req_to_blocks.pop(request_id, []))
        self.num_cached_block.pop(request_id, None)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        return 0  # states are per request: nothing is shared (no cascade attention)

    def check_integrity(self) -> None:
        for request_id, blocks in self.req_to_blocks.items():
            require_integrity(
                len(blocks) == 1 and not blocks[0].is_null,
                f"{request_id} holds {len(blocks)} blocks in Mamba group "
                f"{self.kv_cache_group_id} (exactly one state block expected)",
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
        return tuple([] for _ in kv_cache_group_ids)
