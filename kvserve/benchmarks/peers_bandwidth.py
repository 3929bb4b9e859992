"""Single streams of `kvserve bench peers` against the machine's memory read bound.

One decode step of one sequence reads every layer weight and the LM head once, so a single
stream's output tok/s times the GGUF's weight bytes per token is the read rate it reached;
set against the probe's two-thread rate (benchmarks/memory.py) it says how close the engine
came to the bound. The bytes are the file's own (Q4_1 blocks for the default model): what
llama.cpp reads, and what kvserve's lossless path reads too (it computes from the blocks).
"""

from __future__ import annotations

from kvserve.benchmarks.memory import BOUND_THREADS, read_bound
from kvserve.benchmarks.peers_workloads import EngineResult


def weight_bytes_per_token(gguf_path: str) -> int:
    """Bytes of every tensor one decode step reads: all of them, with a tied embedding
    counted once (as the LM head; the embedding lookup itself reads one row); an untied
    one is left out (one row again)."""
    from kvserve.transformers_utils.gguf_reader import open_gguf

    tensors = {t.name: t for t in open_gguf(gguf_path).tensors}
    untied = "output.weight" in tensors
    return sum(
        t.data.nbytes for name, t in tensors.items() if not (untied and name == "token_embd.weight")
    )


def annotate_single_streams(
    results: list[EngineResult], single_stream: set[str], bytes_per_token: int, rates: list[float]
) -> list[str]:
    """Add the weight read rate and its fraction of the read bound to every result of a
    single-stream workload; one note per result. The elapsed time includes the short
    prompt's prefill, so the fraction slightly understates the decode's."""
    bound = read_bound(rates)
    threads = min(BOUND_THREADS, len(rates))
    notes = []
    for r in results:
        if r.workload not in single_stream:
            continue
        gb_s = bytes_per_token * r.output_tok_s / 1e9
        r.extra["weight_bytes_per_token"] = bytes_per_token
        r.extra["weight_read_gb_s"] = gb_s
        r.extra["read_bound_fraction"] = gb_s / bound
        notes.append(
            f"workload {r.workload}, {r.engine}: {bytes_per_token / 1e6:.0f} MB of weights per "
            f"token x {r.output_tok_s:.1f} tok/s = {gb_s:.1f} GB/s, {100 * gb_s / bound:.0f}% "
            f"of the {threads}-thread read bound ({bound:.1f} GB/s)"
        )
    return notes
