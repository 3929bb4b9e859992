"""StructuredOutputManager: compiles grammars off the engine loop, caches them by spec, and
fills the per-step bitmask of the batch's constrained rows (vLLM v1's design)."""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import torch

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured_output.backend_types import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
    get_backend_class,
    resolve_backend,
)
from kvserve.structured_output.request import StructuredOutputRequest

logger = logging.getLogger(__name__)

# Compiled grammars kept (least recently used dropped first): an agent's few schemas
# compile once, a stream of one-off schemas cannot grow the cache without bound. At most
# GRAMMAR_CACHE_SIZE of them and, where the backend reports their size (xgrammar's are
# 0.1-10 MB with a 50k-token vocabulary), at most KVSERVE_GRAMMAR_CACHE_MB in all.
GRAMMAR_CACHE_SIZE = 256
GRAMMAR_CACHE_MB_ENV = "KVSERVE_GRAMMAR_CACHE_MB"
DEFAULT_GRAMMAR_CACHE_MB = 512


class StructuredOutputManager:
    """Lives in the engine core. ``grammar_init`` returns at once; the compile runs on a
    thread pool and the scheduler keeps the request in WAITING_FOR_FSM until it is done.

    ``load_tokenizer`` is called on a compile thread the first time a backend is needed,
    so an engine that never sees a grammar never pays for it.
    """

    def __init__(
        self,
        backend: str,
        vocab_size: int,
        max_num_seqs: int,
        load_tokenizer: Callable[[], Any],
    ) -> None:
        self.default_backend = backend
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self._load_tokenizer = load_tokenizer
        self._tokenizer: Any = None
        self._backends: dict[str, StructuredOutputBackend] = {}
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, bytes], tuple[Any, int]] = OrderedDict()
        self._cache_bytes = 0
        self.max_cache_bytes = int(
            float(os.environ.get(GRAMMAR_CACHE_MB_ENV, DEFAULT_GRAMMAR_CACHE_MB)) * 2**20
        )
        self.num_compiles = 0  # cache misses, for tests and stats
        # Its own lock: _lock is held through a first tokenizer load, which the engine
        # loop must not wait for.
        self._pending_lock = threading.Lock()
        self._pending: set[Future[StructuredOutputGrammar]] = set()
        # Half the cores at most: compiles must not starve the model's forward.
        workers = max(1, min(8, (os.cpu_count() or 2) // 2))
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="grammar-compile")
        self._bitmask = torch.full((max_num_seqs, (vocab_size + 31) // 32), -1, dtype=torch.int32)

    # --- compile -------------------------------------------------------------------

    def grammar_init(self, request: StructuredOutputRequest) -> None:
        """Starts compiling ``request``'s grammar; its ``grammar`` property tells when done."""
        future = self._executor.submit(self._new_grammar, request.params)
        with self._pending_lock:
            self._pending.add(future)
        # A done future holds its grammar (a matcher over the whole vocabulary): kept in
        # _pending, every structured request's matcher would outlive the request.
        future.add_done_callback(self._forget_compile)
        request.set_future(future)

    def _forget_compile(self, future: Future[StructuredOutputGrammar]) -> None:
        with self._pending_lock:
            self._pending.discard(future)

    def request_census(self) -> dict[str, int]:
        with self._pending_lock:
            return {"pending_compiles": len(self._pending)}

    def wait_for_compiles(self, timeout: float) -> None:
        """Blocks until a pending compile finishes or ``timeout`` passes: an engine whose
        only requests wait for grammars sleeps here instead of spinning empty steps."""
        with self._pending_lock:
            pending = set(self._pending)
        if pending:
            wait(pending, timeout, return_when=FIRST_COMPLETED)

    def _new_grammar(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        backend = self._backend(params._backend or resolve_backend(self.default_backend, params))
        # The whole spec, options included, is the key: two requests with the same schema
        # but different whitespace rules get different grammars.
        key = (backend.name, _spec_key(params))
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
        if cached is not None:
            return backend.new_grammar(cached[0])
        compiled = backend.compile(params)
        size = int(getattr(compiled, "memory_size_bytes", 0))
        with self._lock:
            self.num_compiles += 1
            old = self._cache.pop(key, None)  # compiled twice at once: one entry stays
            self._cache_bytes += size - (old[1] if old else 0)
            self._cache[key] = (compiled, size)
            while len(self._cache) > GRAMMAR_CACHE_SIZE or (
                self._cache_bytes > self.max_cache_bytes and len(self._cache) > 1
            ):
                _, (_, dropped) = self._cache.popitem(last=False)
                self._cache_bytes -= dropped
        return backend.new_grammar(compiled)

    def cache_stats(self) -> tuple[int, int]:
        """(grammars, bytes the backend reports for them) in the compile cache."""
        with self._lock:
            return len(self._cache), self._cache_bytes

    def _backend(self, name: str) -> StructuredOutputBackend:
        with self._lock:
            backend = self._backends.get(name)
            if backend is None:
                if self._tokenizer is None:
                    self._tokenizer = self._load_tokenizer()
                backend = get_backend_class(name)(self._tokenizer, self.vocab_size)
                self._backends[name] = backend
            return backend

    # --- per step ------------------------------------------------------------------

    def grammar_bitmask(
        self,
        grammars: Sequence[StructuredOutputGrammar],
        drafts: Sequence[list[int]] | None = None,
        free_rows: Sequence[int] | None = None,
    ) -> np.ndarray:
        """[rows, ceil(V/32)] int32: grammar i's rows allow the tokens it allows next, then
        after each of its drafts (``drafts[i]``, accepted into the matcher to fill the next
        row and rolled back after), one row per position a speculative step samples.
        ``free_rows[i]``: its first rows are still reasoning (ReasoningGate), left
        unmasked; the grammar starts at the row after, with the drafts from there."""
        drafts = drafts if drafts is not None else [[] for _ in grammars]
        free_rows = free_rows if free_rows is not None else [0] * len(grammars)
        num = sum(1 + len(d) for d in drafts)
        if num > self._bitmask.shape[0]:
            self._bitmask = torch.full((num, self._bitmask.shape[1]), -1, dtype=torch.int32)
        bitmask = self._bitmask[:num]
        bitmask.fill_(-1)
        row = 0
        for grammar, tokens, free in zip(grammars, drafts, free_rows, strict=True):
            accepted = 0
            for position in range(free, 1 + len(tokens)):
                if not grammar.is_terminated():
                    grammar.fill_bitmask(bitmask, row + position)
                if position < len(tokens) and grammar.accept_tokens("draft", [tokens[position]]):
                    accepted += 1
                elif position < len(tokens):
                    break  # drafts were validated; a refusal leaves the rest unmasked
            if accepted:
                grammar.rollback(accepted)
            row += 1 + len(tokens)
        # A copy: the buffer is refilled next step while the worker may still hold this one.
        return bitmask.numpy().copy()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _spec_key(params: StructuredOutputsParams) -> bytes:
    import msgspec

    # Where the reasoning ends is the request's, not the grammar's: one compile serves both.
    return msgspec.msgpack.encode(msgspec.structs.replace(params, _reasoning=None))
