"""llama.cpp's decode at a long context (llama-cpp-python's low-level API), for `kvserve
bench long-context`: every stream's prompt prefilled in its own KV stream (untimed), then
greedy decode steps of one token per stream in one llama_decode each, timed."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

N_BATCH = 2048


def llamacpp_decode_rate(
    gguf_path: str,
    prompts: list[list[int]],
    output_len: int,
    threads: int,
    extra_buffer_types: bool = True,
    prefill_tokens_per_decode: int = N_BATCH,
) -> dict[str, Any]:
    import llama_cpp as lc

    quiet = lc.llama_log_callback(lambda level, text, data: None)
    lc.llama_log_set(quiet, None)
    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    mparams.use_extra_bufts = extra_buffer_types  # off: see peers_llamacpp.extra_buffer_types_run
    model = lc.llama_model_load_from_file(gguf_path.encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf_path}")
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    streams = len(prompts)
    per_seq = -(-(len(prompts[0]) + output_len + 1) // 256) * 256
    cparams = lc.llama_context_default_params()
    cparams.n_seq_max = streams
    cparams.kv_unified = False  # one KV stream per sequence, as kvserve's requests
    cparams.n_ctx = streams * per_seq
    cparams.n_batch = cparams.n_ubatch = N_BATCH
    cparams.n_threads = cparams.n_threads_batch = threads
    cparams.no_perf = True
    ctx = lc.llama_init_from_model(model, cparams)
    if not ctx:
        lc.llama_model_free(model)
        raise RuntimeError("llama.cpp could not create a context (n_ctx too large?)")
    batch = lc.llama_batch_init(max(N_BATCH, streams), 0, 1)

    def decode(tokens: list[tuple[int, int, int, bool]]) -> None:
        for i, (token, pos, seq, logits) in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, int(logits)
        batch.n_tokens = len(tokens)
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed (KV cache full?)")

    def argmax(row: int) -> int:
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, row), shape=(n_vocab,))
        return int(logits.argmax())

    try:
        start = time.perf_counter()
        next_tokens = []
        for seq, prompt in enumerate(prompts):
            for c in range(0, len(prompt), prefill_tokens_per_decode):
                chunk = prompt[c : c + prefill_tokens_per_decode]
                last = c + len(chunk) == len(prompt)
                decode([(t, c + i, seq, last and i == len(chunk) - 1) for i, t in enumerate(chunk)])
            next_tokens.append(argmax(len(chunk) - 1))
        prefill_s = time.perf_counter() - start
        step_s = []
        for step in range(output_len):
            t0 = time.perf_counter()
            decode([(t, len(prompts[s]) + step, s, True) for s, t in enumerate(next_tokens)])
            next_tokens = [argmax(s) for s in range(streams)]
            step_s.append(time.perf_counter() - t0)
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(model)
    return {
        "decode_tok_s": streams * len(step_s) / sum(step_s),
        "median_step_ms": statistics.median(step_s) * 1e3,
        "decode_steps": len(step_s),
        "prefill_s": prefill_s,
        "kv_cache": "float16 (llama.cpp's default)",
    }
