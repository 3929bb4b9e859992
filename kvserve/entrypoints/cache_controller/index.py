"""TierIndex: {instance -> {tier -> chunk hashes}}, learned from KV events.

Two streams feed it per instance: the engine's own KV events (its paged device cache,
medium "GPU": block hashes of core/kv_cache_utils.py, block_size tokens each) and the KV
tier's events (kvserve/distributed/tier_events.py, medium "cpu" / "disk" / "remote":
chunk hashes of kvcache/chunking.py, chunk_size tokens each). Both hashes are chained
and seeded, so the index hashes a prompt the way each side does and counts the leading
run of hashes an instance holds in each tier: the prefix it would not recompute.

Only the full-attention group counts for the device cache (group 0, or no group), as in
the router's PrefixIndex. Not locked: the controller guards it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvserve.core.kv_cache_utils import compute_none_hash, hash_block_tokens
from kvserve.kvcache.chunking import hash_chunk, root_hash
from kvserve.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)

DEVICE = "device"
TIERS = (DEVICE, "cpu", "disk", "remote")


def tier_of(medium: str | None) -> str:
    """The tier an event's medium names: the engine's paged cache says "GPU" (or nothing)."""
    if medium is None or medium.upper() in ("GPU", "DEVICE"):
        return DEVICE
    tier = medium.lower()
    if tier not in TIERS:
        raise ValueError(f"unknown KV event medium {medium!r}")
    return tier


@dataclass(frozen=True)
class PromptHashes:
    """A prompt hashed the way one layout's device cache and tier do."""

    block_size: int
    blocks: list[bytes]
    chunks: list[tuple[int, bytes]]  # (end token, hash) per chunk


@dataclass(frozen=True)
class HashLayout:
    """How one instance hashes: its device blocks and its tier's chunks."""

    block_size: int
    block_hash_seed: int
    chunk_size: int
    chunk_hash_seed: int
    save_unfull_chunk: bool = False

    def hash(self, tokens: Sequence[int], cache_salt: str | None) -> PromptHashes:
        return PromptHashes(
            self.block_size,
            self.block_hashes(tokens, cache_salt),
            self.chunk_hashes(tokens, cache_salt),
        )

    def block_hashes(self, tokens: Sequence[int], cache_salt: str | None) -> list[bytes]:
        hashes: list[bytes] = []
        parent = compute_none_hash(self.block_hash_seed)
        size = self.block_size
        for i in range(len(tokens) // size):
            extra = (cache_salt,) if i == 0 and cache_salt else None
            parent = hash_block_tokens(parent, tokens[i * size : (i + 1) * size], extra)
            hashes.append(parent)
        return hashes

    def chunk_hashes(
        self, tokens: Sequence[int], cache_salt: str | None
    ) -> list[tuple[int, bytes]]:
        """(end token, hash) of each chunk the tier would store for tokens."""
        tags = () if cache_salt is None else (("salt", cache_salt),)
        out: list[tuple[int, bytes]] = []
        parent = root_hash(self.chunk_hash_seed)
        for start in range(0, len(tokens), self.chunk_size):
            end = min(start + self.chunk_size, len(tokens))
            if end - start < self.chunk_size and not self.save_unfull_chunk:
                break
            parent = hash_chunk(parent, tokens[start:end], tags)
            out.append((end, parent))
        return out


class TierIndex:
    def __init__(self) -> None:
        self._held: dict[str, dict[str, set[bytes]]] = {}

    def apply(self, instance: str, events: Iterable[KVCacheEvent]) -> None:
        """Follows one instance's events, in the order one stream published them."""
        tiers = self._held.setdefault(instance, {})
        for event in events:
            if isinstance(event, BlockStored | BlockRemoved):
                tier = tier_of(event.medium)
                if tier == DEVICE and event.group_id not in (None, 0):
                    continue
                held = tiers.setdefault(tier, set())
                if isinstance(event, BlockStored):
                    held.update(event.block_hashes)
                else:
                    held.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):  # the engine's prefix cache reset
                tiers.pop(DEVICE, None)

    def replace(self, instance: str, tier: str, hashes: Iterable[bytes]) -> None:
        """What one tier holds now, as the instance listed it (its events then follow)."""
        self._held.setdefault(instance, {})[tier] = set(hashes)

    def forget(self, instance: str, tiers: Iterable[str] | None = None) -> None:
        """Drops what the index knows of the instance (of those tiers only, if given)."""
        if tiers is None:
            self._held.pop(instance, None)
            return
        for tier in tiers:
            self._held.get(instance, {}).pop(tier, None)

    def counts(self, instance: str) -> dict[str, int]:
        """Hashes held per tier (device blocks, tier chunks)."""
        return {tier: len(h) for tier, h in self._held.get(instance, {}).items() if h}

    def match(self, instance: str, prompt: PromptHashes) -> dict[str, int]:
        """Prefix tokens of the prompt the instance holds, per tier that holds any."""
        found: dict[str, int] = {}
        for tier, held in self._held.get(instance, {}).items():
            n = 0
            if tier == DEVICE:
                for h in prompt.blocks:
                    if h not in held:
                        break
                    n += prompt.block_size
            else:
                for end, h in prompt.chunks:
                    if h not in held:
                        break
                    n = end
            if n:
                found[tier] = n
        return found
