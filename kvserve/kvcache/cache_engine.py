"""CacheEngine: store, find and fetch chunks of KV by token ids, across the storage tiers.

The KV of a run of tokens is one tensor shaped [num_layers, 2, num_tokens, num_kv_heads,
head_size] (token axis TOKEN_DIM); the caller (a KV connector) maps its paged blocks to and
from that shape. The engine knows nothing else about who calls it.

Lookup pins the chunks it found under a lookup id, so they cannot be evicted between the
scheduler's lookup and the worker's retrieve; retrieve(lookup_id=...) or release(lookup_id)
unpins them, and a second lookup under the same id releases the first one's pins.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvserve.kvcache.chunking import Chunk, ChunkedTokenDatabase
from kvserve.kvcache.config import CacheEngineConfig
from kvserve.kvcache.integrity import PLAIN, KVAuthenticator
from kvserve.kvcache.key import CacheEngineKey, CacheEngineMetadata
from kvserve.kvcache.stats import CacheStats
from kvserve.kvcache.storage.base import StorageBackend
from kvserve.kvcache.storage.manager import StorageManager, create_backends

TOKEN_DIM = 2
Tags = tuple[tuple[str, str], ...]
# The tag of position-independent segment chunks (CacheBlend).
SEGMENT_TAG = ("kind", "blend_segment")


@dataclass
class RetrieveResult:
    num_tokens: int = 0
    # (start, end, kv of tokens[start:end]) in order, contiguous.
    chunks: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)

    def kv(self) -> torch.Tensor | None:
        if not self.chunks:
            return None
        return torch.cat([t for _, _, t in self.chunks], dim=TOKEN_DIM)


class CacheEngine:
    def __init__(
        self,
        config: CacheEngineConfig,
        metadata: CacheEngineMetadata,
        backends: list[StorageBackend] | None = None,
        stats: CacheStats | None = None,
        auth: KVAuthenticator = PLAIN,
    ) -> None:
        self.config = config
        self.metadata = metadata
        self.stats = stats or CacheStats()
        self.token_db = ChunkedTokenDatabase(metadata, config.chunk_size, config.hash_seed)
        self.storage = StorageManager(
            backends if backends is not None else create_backends(config, self.stats, auth)
        )
        self.auth = auth
        self._pins: dict[str, list[tuple[StorageBackend, CacheEngineKey]]] = {}
        # Pins an operator placed (pin_prefix), per (tier, key): only these unpin_prefix drops.
        self._held: Counter[tuple[str, CacheEngineKey]] = Counter()
        self._pin_lock = threading.Lock()
        self._prefetcher: ThreadPoolExecutor | None = None

    @property
    def chunk_size(self) -> int:
        return self.config.chunk_size

    def chunks(self, tokens: Sequence[int], tags: Tags = ()) -> list[Chunk]:
        """The chunks this engine stores and finds for tokens (partial last chunk only with
        save_unfull_chunk), so save and load agree on the chunk policy."""
        return list(self.token_db.chunks(tokens, self.config.save_unfull_chunk, tags))

    def store(
        self, tokens: Sequence[int], kv: torch.Tensor, start: int = 0, tags: Tags = ()
    ) -> int:
        """Stores the chunks of tokens whose KV `kv` holds; kv covers tokens[start:start +
        kv.shape[TOKEN_DIM]] and start is chunk-aligned. Returns the token count stored (or
        already held) from start."""
        if start % self.chunk_size:
            raise ValueError(
                f"start ({start}) must be a multiple of chunk_size ({self.chunk_size})"
            )
        kv_end = start + kv.shape[TOKEN_DIM]
        if kv_end > len(tokens):
            raise ValueError(
                f"kv covers tokens up to {kv_end}, but only {len(tokens)} tokens given"
            )
        t0 = time.perf_counter()
        stored = 0
        for chunk in self.chunks(tokens, tags):
            if chunk.start < start:
                continue
            if chunk.end > kv_end:
                break
            self.storage.put(
                chunk.key, kv.narrow(TOKEN_DIM, chunk.start - start, chunk.end - chunk.start)
            )
            stored = chunk.end - start
        self.stats.observe_store(time.perf_counter() - t0)
        return stored

    def lookup(self, tokens: Sequence[int], lookup_id: str | None = None, tags: Tags = ()) -> int:
        """How many prefix tokens the tiers hold (a chunk boundary, or the end of a stored
        partial last chunk). With a lookup_id the found chunks are pinned until released."""
        if lookup_id is not None:
            self.release(lookup_id)
        hit = 0
        pinned: list[tuple[StorageBackend, CacheEngineKey]] = []
        for chunk in self.chunks(tokens, tags):
            backend = self.storage.contains(chunk.key)
            if backend is None:
                break
            if lookup_id is not None and backend.pin(chunk.key):
                pinned.append((backend, chunk.key))
            hit = chunk.end
        if lookup_id is not None:
            with self._pin_lock:
                self._pins[lookup_id] = pinned
        self.stats.observe_lookup(len(tokens), hit)
        return hit

    def release(self, lookup_id: str) -> None:
        """Unpins what lookup(lookup_id) pinned; a no-op for an unknown or released id."""
        with self._pin_lock:
            pinned = self._pins.pop(lookup_id, [])
        for backend, key in pinned:
            backend.unpin(key)

    def pin_prefix(self, tokens: Sequence[int], medium: str, tags: Tags = ()) -> int:
        """Keeps the stored prefix of tokens in tier ``medium`` from eviction until
        unpin_prefix; returns the prefix tokens pinned (up to the first chunk it lacks)."""
        backend = self.storage.by_medium(medium)
        pinned = 0
        for chunk in self.chunks(tokens, tags):
            if not backend.pin(chunk.key):
                break
            with self._pin_lock:
                self._held[(medium, chunk.key)] += 1
            pinned = chunk.end
        return pinned

    def unpin_prefix(self, tokens: Sequence[int], medium: str, tags: Tags = ()) -> int:
        """Drops one pin_prefix pin of each chunk of tokens in that tier (never a lookup's
        pin); returns the prefix tokens unpinned."""
        backend = self.storage.by_medium(medium)
        unpinned = 0
        for chunk in self.chunks(tokens, tags):
            with self._pin_lock:
                if self._held[(medium, chunk.key)] <= 0:
                    break
                self._held[(medium, chunk.key)] -= 1
                if not self._held[(medium, chunk.key)]:
                    del self._held[(medium, chunk.key)]
            backend.unpin(chunk.key)
            unpinned = chunk.end
        return unpinned

    def clear_medium(self, medium: str) -> None:
        """Empties one tier, its pins included (a shared remote tier too: the caller asked)."""
        backend = self.storage.by_medium(medium)
        with self._pin_lock:
            for held in [h for h in self._held if h[0] == medium]:
                del self._held[held]
        backend.clear()

    def num_pinned_lookups(self) -> int:
        with self._pin_lock:
            return len(self._pins)

    def retrieve(
        self,
        tokens: Sequence[int],
        max_tokens: int | None = None,
        lookup_id: str | None = None,
        tags: Tags = (),
        start: int = 0,
    ) -> RetrieveResult:
        """The KV of the longest stored prefix of tokens (at most max_tokens), chunk by
        chunk; stops at the first chunk no tier can give back. Chunks that end at or before
        `start` (KV the caller already has) are skipped, so the first chunk returned is the
        one holding token `start`; num_tokens is where the returned run ends."""
        t0 = time.perf_counter()
        result = RetrieveResult(num_tokens=start)
        try:
            limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
            for chunk in self.chunks(tokens, tags):
                if chunk.end <= start:
                    continue
                if chunk.end > limit:
                    break
                kv = self.storage.get(chunk.key)
                if kv is None:
                    break
                result.chunks.append((chunk.start, chunk.end, kv))
                result.num_tokens = chunk.end
        finally:
            if lookup_id is not None:
                self.release(lookup_id)
        self.stats.observe_retrieve(time.perf_counter() - t0)
        return result

    # ---- position-independent segments (CacheBlend) ---------------------------------------
    # A segment's chunks are keyed by its own tokens alone (the chain starts at the
    # segment, not the prompt), with its short last chunk, under a tag that keeps them
    # apart from prefix chunks. The caller decides what position the KV is stored at.

    def _segment_chunks(self, tokens: Sequence[int], tags: Tags) -> list[Chunk]:
        return list(self.token_db.chunks(tokens, True, (*tags, SEGMENT_TAG)))

    def store_segment(self, tokens: Sequence[int], kv: torch.Tensor, tags: Tags = ()) -> None:
        """Stores the KV of a whole segment (kv covers every token of tokens)."""
        if kv.shape[TOKEN_DIM] != len(tokens):
            raise ValueError(
                f"a segment's kv covers {kv.shape[TOKEN_DIM]} tokens, not {len(tokens)}"
            )
        t0 = time.perf_counter()
        for chunk in self._segment_chunks(tokens, tags):
            self.storage.put(chunk.key, kv.narrow(TOKEN_DIM, chunk.start, chunk.end - chunk.start))
        self.stats.observe_store(time.perf_counter() - t0)

    def contains_segment(self, tokens: Sequence[int], tags: Tags = ()) -> bool:
        """Whether every chunk of the segment is held by some tier."""
        return all(
            self.storage.contains(chunk.key) is not None
            for chunk in self._segment_chunks(tokens, tags)
        )

    def retrieve_segment(self, tokens: Sequence[int], tags: Tags = ()) -> torch.Tensor | None:
        """The KV of the whole segment, or None when any chunk is missing (a segment is
        reused whole or not at all)."""
        t0 = time.perf_counter()
        parts: list[torch.Tensor] = []
        for chunk in self._segment_chunks(tokens, tags):
            kv = self.storage.get(chunk.key)
            if kv is None:
                parts = []
                break
            parts.append(kv)
        self.stats.observe_lookup(len(tokens), len(tokens) if parts else 0)
        self.stats.observe_retrieve(time.perf_counter() - t0)
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=TOKEN_DIM)

    def prefetch(self, tokens: Sequence[int], tags: Tags = ()) -> Future[int]:
        """Brings the stored prefix of tokens into the CPU tier in the background; the future
        gives the number of prefix tokens now in CPU memory."""
        if self._prefetcher is None:
            self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="kvcache-prefetch")
        chunks = self.chunks(tokens, tags)

        def run() -> int:
            done = 0
            for chunk in chunks:
                if not self.storage.promote(chunk.key):
                    break
                done = chunk.end
            return done

        return self._prefetcher.submit(run)

    def flush(self, timeout: float | None = None) -> None:
        """Waits until writes queued off the request path (the disk tier) are done."""
        self.storage.flush(timeout)

    def clear(self, include_remote: bool = False) -> None:
        """Empties the local tiers (and the remote one, shared by others, only if asked)."""
        with self._pin_lock:
            self._pins.clear()
            self._held.clear()
        self.storage.clear(include_remote)

    def health(self) -> dict[str, bool]:
        return self.storage.health()

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True)
        self.storage.close()
