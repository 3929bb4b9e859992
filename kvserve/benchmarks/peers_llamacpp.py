"""llama.cpp (llama-cpp-python's low-level API) on the same GGUF, for `kvserve bench peers`.

llama.cpp at its best batches too: up to n_parallel sequences share every llama_decode
call (as its batched-bench and server do), each in its own KV stream (n_seq_max,
kv_unified off). A finished sequence's slot is cleared and refilled with the next request
at once (continuous batching); new prompts are prefilled in the same llama_decode as the
running sequences' decode tokens, chunked to n_batch. Sampling is greedy (argmax of the
logits llama.cpp returns for the last prompt token and every decode token).

llama.cpp runs the GGUF as stored (Q4_1 for the default model): it reads ~4x fewer weight
bytes per token than the float32 engines, which matters for memory-bound decode.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from kvserve.benchmarks.peers_workloads import EngineResult, PeerRequest

LLAMACPP_SKIPPED = "llama.cpp: skipped (pip install llama-cpp-python)"
N_BATCH = 2048
N_UBATCH = 512


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def extra_buffer_types_run(
    gguf_path: str, threads: int | None, tokens_per_decode: int = N_BATCH
) -> bool:
    """Whether llama.cpp survives a small prefill and decode with its extra CPU buffer
    types (AMX, weight repacking), fed at most ``tokens_per_decode`` tokens per
    llama_decode, tried in a child process: a build for a CPU that advertises AMX dies with
    SIGILL in its tile kernels (which serve batches) on VMs that do not really run them."""
    probe = (
        "import sys; from kvserve.benchmarks.peers_llamacpp import LlamaCppPeer as P; "
        "from kvserve.benchmarks.peers_workloads import PeerRequest as R; "
        "P(sys.argv[1], int(sys.argv[2]) or None, tokens_per_decode=int(sys.argv[3]))"
        ".run('probe', [R(list(range(100, 164)), 2)], 1, False)"
    )
    child = subprocess.run(
        [sys.executable, "-c", probe, gguf_path, str(threads or 0), str(tokens_per_decode)],
        capture_output=True,
        timeout=300,
    )
    return child.returncode == 0


def open_llamacpp(gguf_path: str, threads: int | None, notes: list[str]) -> LlamaCppPeer | None:
    """The llama.cpp peer, or None (with a printed and noted skip) when not installed."""
    if not llama_cpp_available():
        print(LLAMACPP_SKIPPED, flush=True)
        notes.append(LLAMACPP_SKIPPED)
        return None
    if extra_buffer_types_run(gguf_path, threads):
        return LlamaCppPeer(gguf_path, threads)
    peer = LlamaCppPeer(gguf_path, threads, extra_buffer_types=False)
    note = (
        "llama.cpp: its extra CPU buffer types (AMX, repacking) crashed a probe decode on this "
        "machine; batched runs go without them (use_extra_bufts off)"
    )
    if extra_buffer_types_run(gguf_path, threads, tokens_per_decode=1):
        # One token per llama_decode keeps to their matrix-vector kernels: llama.cpp's
        # fastest single stream on such a machine, prompt fed a token at a time.
        peer.single_stream = LlamaCppPeer(gguf_path, threads, tokens_per_decode=1)
        note += "; single-stream runs keep them, one token per llama_decode"
    print(note, flush=True)
    notes.append(note)
    return peer


@dataclass
class _Slot:
    request: PeerRequest
    prefilled: int = 0  # prompt tokens already sent
    generated: int = 0
    next_token: int = -1
    logits_row: int = -1  # row of this slot's logits in the last llama_decode, or -1


class LlamaCppPeer:
    def __init__(
        self,
        gguf_path: str,
        n_threads: int | None = None,
        extra_buffer_types: bool = True,
        tokens_per_decode: int = N_BATCH,
    ) -> None:
        import llama_cpp as lc

        self.lc = lc
        self.n_threads = n_threads or os.cpu_count() or 1
        self.extra_buffer_types = extra_buffer_types
        self.tokens_per_decode = tokens_per_decode
        # Serves n_parallel == 1 runs where set (see open_llamacpp).
        self.single_stream: LlamaCppPeer | None = None
        # Kept on self: llama.cpp calls it for as long as the library lives.
        self._quiet_log = lc.llama_log_callback(lambda level, text, data: None)
        lc.llama_log_set(self._quiet_log, None)
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        mparams.use_extra_bufts = extra_buffer_types
        self.model = lc.llama_model_load_from_file(gguf_path.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))

    def close(self) -> None:
        if self.single_stream is not None:
            self.single_stream.close()
        self.lc.llama_model_free(self.model)

    def _new_context(self, n_parallel: int, max_len: int) -> Any:
        lc = self.lc
        cparams = lc.llama_context_default_params()
        cparams.n_seq_max = n_parallel
        cparams.kv_unified = False  # one KV stream per sequence: attention never spans others
        cparams.n_ctx = n_parallel * (-(-max_len // 256) * 256)
        cparams.n_batch = N_BATCH
        cparams.n_ubatch = N_UBATCH
        cparams.n_threads = cparams.n_threads_batch = self.n_threads
        cparams.no_perf = True
        ctx = lc.llama_init_from_model(self.model, cparams)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        return ctx

    def run(
        self, workload: str, requests: list[PeerRequest], n_parallel: int, progress: bool
    ) -> EngineResult:
        lc = self.lc
        n_parallel = max(1, min(n_parallel, len(requests)))
        if n_parallel == 1 and self.single_stream is not None:
            return self.single_stream.run(workload, requests, n_parallel, progress)
        if n_parallel > self.tokens_per_decode:
            raise ValueError(
                f"{n_parallel} sequences need more than {self.tokens_per_decode} tokens per decode"
            )
        max_len = max(len(r.prompt_token_ids) + r.output_len for r in requests)
        ctx = self._new_context(n_parallel, max_len)
        mem = lc.llama_get_memory(ctx)
        batch = lc.llama_batch_init(N_BATCH, 0, 1)
        try:
            # Warm-up on one short sequence, then an empty cache for the timed run.
            self._generate(
                ctx, mem, batch, [PeerRequest(requests[0].prompt_token_ids[:8], 2)], 1, None
            )
            lc.llama_memory_clear(mem, True)
            bar = tqdm(
                total=sum(r.output_len for r in requests),
                desc=f"llama.cpp x{n_parallel} ({workload})",
                disable=not progress,
            )
            start = time.perf_counter()
            self._generate(ctx, mem, batch, requests, n_parallel, bar)
            elapsed = time.perf_counter() - start
            bar.close()
        finally:
            lc.llama_batch_free(batch)
            lc.llama_free(ctx)
        return EngineResult(
            engine="llamacpp",
            workload=workload,
            elapsed_s=elapsed,
            prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
            output_tokens=sum(r.output_len for r in requests),
            config=f"{n_parallel} seqs/decode, {self.n_threads} threads, GGUF as stored"
            + ("" if self.extra_buffer_types else ", no extra buffer types")
            + (", 1 token per llama_decode" if self.tokens_per_decode == 1 else ""),
        )

    def _generate(
        self, ctx: Any, mem: Any, batch: Any, requests: list[PeerRequest], n_parallel: int, bar: Any
    ) -> None:
        lc = self.lc
        pending = collections.deque(requests)
        slots: list[_Slot | None] = [None] * n_parallel
        while pending or any(slots):
            n = 0

            def add(token: int, pos: int, seq: int, logits: bool) -> None:
                nonlocal n
                batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, pos, 1
                batch.seq_id[n][0], batch.logits[n] = seq, int(logits)
                n += 1

            for s in range(n_parallel):
                if slots[s] is None and pending:
                    slots[s] = _Slot(pending.popleft())
            # Decode tokens first, so running sequences never wait behind a long prefill.
            for s, slot in enumerate(slots):
                if slot is not None and slot.generated > 0:
                    slot.logits_row = n
                    add(
                        slot.next_token,
                        len(slot.request.prompt_token_ids) + slot.generated - 1,
                        s,
                        True,
                    )
            for s, slot in enumerate(slots):
                if slot is None or slot.generated > 0:
                    continue
                slot.logits_row = -1
                prompt = slot.request.prompt_token_ids
                take = min(len(prompt) - slot.prefilled, self.tokens_per_decode - n)
                for p in range(slot.prefilled, slot.prefilled + take):
                    add(prompt[p], p, s, p == len(prompt) - 1)
                slot.prefilled += take
                if slot.prefilled == len(prompt):
                    slot.logits_row = n - 1
            batch.n_tokens = n
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed (KV cache full?)")
            for s, slot in enumerate(slots):
                if slot is None or slot.logits_row < 0:
                    continue
                logits = np.ctypeslib.as_array(
                    lc.llama_get_logits_ith(ctx, slot.logits_row), shape=(self.n_vocab,)
                )
                slot.next_token = int(logits.argmax())
                slot.generated += 1
                if bar is not None:
                    bar.update(1)
                if slot.generated == slot.request.output_len:
                    lc.llama_memory_seq_rm(mem, s, -1, -1)
                    slots[s] = None


def run_llamacpp(
    gguf_path: str,
    workload: str,
    requests: list[PeerRequest],
    parallel: list[int],
    progress: bool,
    peer: LlamaCppPeer | None = None,
) -> tuple[EngineResult, list[EngineResult]]:
    """llama.cpp's best sequences-per-decode among `parallel`, and every try."""
    peer = peer or LlamaCppPeer(gguf_path)
    sizes = sorted({max(1, min(p, len(requests))) for p in parallel})
    tries = [peer.run(workload, requests, p, progress) for p in sizes]
    return max(tries, key=lambda r: r.output_tok_s), tries
