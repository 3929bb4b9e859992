"""Token chunking and chunk hashes.

Tokens are cut into chunks of `chunk_size`; chunk i's hash covers every token before it:

    hash(chunk i) = sha256(msgpack([hash(chunk i-1), token ids of chunk i, tags]))

with the chain's root hash(chunk -1) = sha256(b"kvserve.kvcache.root" + seed as 8 big-endian
bytes). msgpack is canonical here (ints and lists only), so every process and machine with
the same seed, tokens and tags computes the same keys. A last chunk shorter than chunk_size
hashes the same way over its fewer tokens, so it never collides with a full chunk.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import msgspec

from kvserve.kvcache.key import CacheEngineKey, CacheEngineMetadata

_encoder = msgspec.msgpack.Encoder(order="deterministic")


def root_hash(seed: int) -> bytes:
    return hashlib.sha256(b"kvserve.kvcache.root" + seed.to_bytes(8, "big")).digest()


def hash_chunk(parent: bytes, token_ids: Sequence[int], tags: tuple[tuple[str, str], ...]) -> bytes:
    payload = _encoder.encode((parent, list(token_ids), [list(t) for t in tags]))
    return hashlib.sha256(payload).digest()


@dataclass(frozen=True)
class Chunk:
    start: int
    end: int
    key: CacheEngineKey


class ChunkedTokenDatabase:
    """Maps a token sequence to its chunks' (start, end, key), chained from a seeded root."""

    def __init__(self, metadata: CacheEngineMetadata, chunk_size: int = 256, seed: int = 0):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.metadata = metadata
        self.chunk_size = chunk_size
        self.root = root_hash(seed)

    def make_key(self, chunk_hash: bytes, tags: tuple[tuple[str, str], ...] = ()) -> CacheEngineKey:
        m = self.metadata
        return CacheEngineKey(
            m.model_name, m.world_size, m.worker_id, chunk_hash.hex(), m.kv_dtype, tags
        )

    def chunks(
        self,
        token_ids: Sequence[int],
        include_partial: bool = False,
        tags: tuple[tuple[str, str], ...] = (),
    ) -> Iterator[Chunk]:
        """The chunks of token_ids in order; a short last chunk only with include_partial."""
        parent = self.root
        n = len(token_ids)
        for start in range(0, n, self.chunk_size):
            end = min(start + self.chunk_size, n)
            if end - start < self.chunk_size and not include_partial:
                return
            parent = hash_chunk(parent, token_ids[start:end], tags)
            yield Chunk(start, end, self.make_key(parent, tags))
