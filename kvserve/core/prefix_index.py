"""Which instance holds which prefix-cache blocks, learned from their KV cache events.

Each instance publishes BlockStored / BlockRemoved / AllBlocksCleared for its prefix
cache (distributed/kv_events_publisher.py). Following those streams, the index knows the
block hashes every instance holds, and it hashes a new request's tokens exactly as the
engines do (core/kv_cache_utils.py: SHA-256 chained from the seed's root, the cache salt
in the first block), so the longest run of leading blocks an instance holds is the prefix
that instance would not recompute.

Only the full-attention group counts (group 0, or events without a group): a hybrid
model's sliding-window groups keep just a recent window, and a prefix hit needs the full
group anyway. The index is one process's view and holds no locks: its one owner follows
the events, the prefix router (entrypoints/router/) on its event loop, or a data-parallel
front end's load balancer (engine/dp_balancer.py), fed by the events that ride on its
cores' outputs. It lives in core/ (pure Python) so both can import it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kvserve.core.kv_cache_utils import BlockHash, compute_none_hash, hash_block_tokens
from kvserve.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)


def _counts(group_id: int | None) -> bool:
    return group_id is None or group_id == 0


class PrefixIndex:
    def __init__(self, block_size: int, hash_seed: int = 0) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self._root = compute_none_hash(hash_seed)
        self._blocks: dict[str, set[bytes]] = {}  # instance -> block hashes it holds

    @property
    def instances(self) -> list[str]:
        return sorted(self._blocks)

    def num_blocks(self, instance: str) -> int:
        return len(self._blocks.get(instance, ()))

    def apply(self, instance: str, events: Iterable[KVCacheEvent]) -> None:
        """Follows one instance's events, in the order it published them."""
        blocks = self._blocks.setdefault(instance, set())
        for event in events:
            if isinstance(event, BlockStored):
                if event.block_size != self.block_size:
                    raise ValueError(
                        f"{instance} stores blocks of {event.block_size} tokens, the index "
                        f"hashes {self.block_size}"
                    )
                if _counts(event.group_id):
                    blocks.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                if _counts(event.group_id):
                    blocks.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                blocks.clear()

    def forget(self, instance: str) -> None:
        """The instance went away (or its stream broke): nothing it held is trusted; the
        replay of its events, or a fresh start, fills the index again."""
        self._blocks.pop(instance, None)

    def block_hashes(
        self, token_ids: Sequence[int], cache_salt: str | None = None
    ) -> list[BlockHash]:
        """The engine's hashes of the full blocks of ``token_ids``."""
        hashes: list[BlockHash] = []
        parent = self._root
        size = self.block_size
        for index in range(len(token_ids) // size):
            extra = (cache_salt,) if index == 0 and cache_salt else None
            parent = hash_block_tokens(parent, token_ids[index * size : (index + 1) * size], extra)
            hashes.append(parent)
        return hashes

    def match(self, token_ids: Sequence[int], cache_salt: str | None = None) -> dict[str, int]:
        """Prompt tokens each known instance holds as its cached prefix of ``token_ids``."""
        hashes = self.block_hashes(token_ids, cache_salt)
        matched: dict[str, int] = {}
        for instance, blocks in self._blocks.items():
            n = 0
            while n < len(hashes) and hashes[n] in blocks:
                n += 1
            matched[instance] = n * self.block_size
        return matched

    def choose(
        self,
        token_ids: Sequence[int],
        loads: Mapping[str, tuple[int, ...]],
        cache_salt: str | None = None,
    ) -> str:
        """The instance of ``loads`` holding the longest prefix; among equals the one with
        the smallest load (e.g. (requests in flight, requests routed so far)), then the
        first by name."""
        return self.pick(self.match(token_ids, cache_salt), loads)

    @staticmethod
    def pick(matched: Mapping[str, int], loads: Mapping[str, tuple[int, ...]]) -> str:
        """The routing rule on a ``match`` result: longest prefix, smallest load, name."""
        if not loads:
            raise ValueError("no instance to route to")
        return min(loads, key=lambda i: (-matched.get(i, 0), loads[i], i))
