"""Managers for attention that forgets: sliding windows, chunked local attention and
StreamingLLM sinks. A request's blocks that no future query can see are freed as it
advances and replaced by ``null_block``, so its memory stays bounded by the window.

Prefix hits differ from full attention's too: a hit of length L only needs the KV that
the token at position L will attend to, so earlier blocks may be missing (null).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvserve.core.block_pool import BlockPool
from kvserve.core.kv_cache_utils import BlockHash, KVCacheBlock, get_block_content
from kvserve.core.mamba_manager import MambaManager
from kvserve.core.single_type_kv_cache_manager import (
    CrossAttentionManager,
    FullAttentionManager,
    SingleTypeKVCacheManager,
)
from kvserve.protocol.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    KVCacheSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    cdiv,
)

if TYPE_CHECKING:
    from kvserve.core.request import Request


def _lookup(
    block_pool: BlockPool,
    block_hashes: Sequence[BlockHash],
    index: int,
    kv_cache_group_ids: Sequence[int],
    block_size: int,
    request: Request | None,
) -> list[KVCacheBlock] | None:
    content = get_block_content(request, index, block_size) if request else None
    return block_pool.get_cached_block(block_hashes[index], kv_cache_group_ids, content)


class _ForgettingManager(SingleTypeKVCacheManager):
    """What the windowed managers share: a spec of their own type, no cascade prefix."""

    spec_type: type[KVCacheSpec] = KVCacheSpec

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        enable_caching: bool,
    ) -> None:
        if not isinstance(kv_cache_spec, self.spec_type):
            raise TypeError(f"{type(self).__name__} needs a {self.spec_type.__name__}")
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id, enable_caching)
        # What get_num_skipped_tokens reads every step, kept as plain ints.
        self.window = getattr(kv_cache_spec, "sliding_window", 0)
        self.chunk = getattr(kv_cache_spec, "attention_chunk_size", 0)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        return 0  # the shared prefix leaves the view: cascade attention does not apply


class SlidingWindowManager(_ForgettingManager):
    """A query at position q sees keys q-W+1 .. q (W = sliding_window)."""

    spec_type = SlidingWindowSpec

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        # The next query sits at num_computed_tokens and sees back to num_computed - W + 1.
        return max(num_computed_tokens - self.window + 1, 0)

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
        """Right to left: the longest L <= max_length whose last W-1 tokens are cached.

        Blocks before that run are null in the answer. A run reaching back to the first
        block is a hit of its whole length even when shorter than the window.
        """
        assert isinstance(kv_cache_spec, SlidingWindowSpec)
        return _window_hit(
            block_hashes,
            max_length,
            kv_cache_group_ids,
            block_pool,
            kv_cache_spec.block_size,
            cdiv(kv_cache_spec.sliding_window - 1, kv_cache_spec.block_size),
            request,
        )


def _window_hit(
    block_hashes: Sequence[BlockHash],
    max_length: int,
    kv_cache_group_ids: Sequence[int],
    block_pool: BlockPool,
    block_size: int,
    num_needed: int,
    request: Request | None,
    num_leading: int = 0,
) -> tuple[list[KVCacheBlock], ...]:
    """The right-to-left search behind sliding windows (and sinks, whose first
    num_leading blocks must be cached as well)."""
    max_blocks = min(max_length // block_size, len(block_hashes))
    null = block_pool.null_block
    hits: tuple[list[KVCacheBlock], ...] = tuple([null] * max_blocks for _ in kv_cache_group_ids)
    num_contiguous = 0
    end = 0
    for index in range(max_blocks - 1, num_leading - 1, -1):
        cached = _lookup(block_pool, block_hashes, index, kv_cache_group_ids, block_size, request)
        if cached is None:
            num_contiguous = 0
            continue
        for group_hits, block in zip(hits, cached, strict=True):
            group_hits[index] = block
        num_contiguous += 1
        if num_contiguous >= num_needed:
            end = index + num_contiguous
            break
    else:
        end = num_leading + num_contiguous  # the run reaches back to the leading blocks
    end = min(end, max_blocks)
    for index in range(min(num_leading, end)):
        cached = _lookup(block_pool, block_hashes, index, kv_cache_group_ids, block_size, request)
        if cached is None:
            end = index  # a sink block is missing: only the blocks before it are a hit
            break
        for group_hits, block in zip(hits, cached, strict=True):
            group_hits[index] = block
    for group_hits in hits:
        del group_hits[end:]
    return hits


class ChunkedLocalAttentionManager(_ForgettingManager):
    """Llama 4 local layers: a query at q sees keys q // C * C .. q."""

    spec_type = ChunkedLocalAttentionSpec

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.chunk * self.chunk

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
        """Blocks of chunks before the one max_length falls in are never read again, so
        they count as hits (null); from that chunk's start, left to right while cached.

        Hits are only taken at a chunk boundary or later inside the last chunk: a run
        that breaks earlier falls back to the boundary.
        """
        assert isinstance(kv_cache_spec, ChunkedLocalAttentionSpec)
        block_size = kv_cache_spec.block_size
        max_blocks = min(max_length // block_size, len(block_hashes))
        chunk_start = (max_blocks * block_size) // kv_cache_spec.attention_chunk_size
        first = chunk_start * kv_cache_spec.attention_chunk_size // block_size
        null = block_pool.null_block
        hits: tuple[list[KVCacheBlock], ...] = tuple([null] * first for _ in kv_cache_group_ids)
        for index in range(first, max_blocks):
            cached = _lookup(
                block_pool, block_hashes, index, kv_cache_group_ids, block_size, request
            )
            if cached is None:
                break
            for group_hits, block in zip(hits, cached, strict=True):
                group_hits.append(block)
        return hits


class SinkFullAttentionManager(_ForgettingManager):
    """StreamingLLM: the first sink_len tokens stay, the rest is a window of W tokens
    (see SinkFullAttentionSpec for the position rule)."""

    spec_type = SinkFullAttentionSpec

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        enable_caching: bool,
    ) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id, enable_caching)
        assert isinstance(kv_cache_spec, SinkFullAttentionSpec)
        self.num_kept_leading_blocks = kv_cache_spec.num_sink_blocks

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(num_computed_tokens - self.window + 1, 0)

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
        """The sink blocks and the last W-1 tokens before the hit end must be cached."""
        assert isinstance(kv_cache_spec, SinkFullAttentionSpec)
        return _window_hit(
            block_hashes,
            max_length,
            kv_cache_group_ids,
            block_pool,
            kv_cache_spec.block_size,
            cdiv(kv_cache_spec.sliding_window - 1, kv_cache_spec.block_size),
            request,
            num_leading=kv_cache_spec.num_sink_blocks,
        )


# Spec kind -> manager class (the registry the coordinator builds its managers from).
spec_manager_map: dict[str, type[SingleTypeKVCacheManager]] = {
    "full_attention": FullAttentionManager,
    "mla_attention": FullAttentionManager,  # one latent per token, same block rules
    "sliding_window": SlidingWindowManager,
    "chunked_local_attention": ChunkedLocalAttentionManager,
    "sink_full_attention": SinkFullAttentionManager,
    "mamba": MambaManager,
    "cross_attention": CrossAttentionManager,
}


def get_manager_class(kv_cache_spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    manager_class = spec_manager_map.get(kv_cache_spec.kind)
    if manager_class is None:
        raise TypeError(f"no KV cache manager for {kv_cache_spec!r}")
    return manager_class


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int, enable_caching: bool
) -> SingleTypeKVCacheManager:
    return get_manager_class(kv_cache_spec)(
        kv_cache_spec, block_pool, kv_cache_group_id, enable_caching
    )
