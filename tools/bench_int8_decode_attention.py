"""Decode attention kernel microbenchmark: float16 cache vs int8 cache vs the int8 kernel
of another revision (built here as a separate library under a renamed op).

One process, variants interleaved round by round (A/B/C, A/B/C, ...), so that a shared
machine's load falls on all of them alike. 1 thread: per-thread CPU time
(time.thread_time, the call runs on the calling thread); 2 threads: wall time. Each
call reads a different copy of the cache where copies fit, so that the cache comes from
memory as in a real step (the weights stream through between layers).

    PYTHONPATH=. python tools/bench_int8_decode_attention.py --baseline-rev main
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvserve import _custom_ops as ops
from kvserve.attention.backends.kv_cache_codec import SCALE_BYTES, quantize

HEADS, KV_HEADS, HEAD, BLOCK = 32, 8, 64, 16  # Llama-3.2-1B's attention
COPY_BYTES = 256 << 20  # caches cycled through per variant, at least this many bytes


def _old_op(rev: str) -> Callable[..., None]:
    """``rev``'s int8 kernel, registered as kvserve::cache_and_decode_attention_int8_old."""
    from torch.utils import cpp_extension

    root = Path(__file__).resolve().parent.parent
    csrc = root / "kvserve" / "csrc"
    source = subprocess.run(
        ["git", "-C", str(root), "show", f"{rev}:kvserve/csrc/decode_attention_int8.cpp"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    source = source.replace(
        "cache_and_decode_attention_int8", "cache_and_decode_attention_int8_old"
    )
    build = Path(tempfile.gettempdir()) / f"kvint8_old_{rev.replace('/', '_')}"
    build.mkdir(exist_ok=True)
    path = build / "decode_attention_int8_old.cpp"
    if not path.exists() or path.read_text() != source:
        path.write_text(source)
    cpp_extension.load(
        name=f"kvint8_old_{rev.replace('/', '_')}", sources=[str(path)],
        extra_include_paths=[str(csrc)],
        extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp", "-march=native"],
        extra_ldflags=["-fopenmp"], is_python_module=False, build_directory=str(build),
    )  # fmt: skip
    return torch.ops.kvserve.cache_and_decode_attention_int8_old


def _case(context: int, reqs: int, int8: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    blocks = -(-context // BLOCK) * reqs
    width = HEAD + SCALE_BYTES if int8 else HEAD
    shape = (2, blocks, BLOCK, KV_HEADS, width)
    nbytes = 2 * blocks * BLOCK * KV_HEADS * width * (1 if int8 else 2)
    copies = max(1, min(8, COPY_BYTES // nbytes))
    caches = []
    for _ in range(copies):
        cache = torch.empty(shape, dtype=torch.int8 if int8 else torch.float16)
        for b in range(0, blocks, 1024):  # in pieces: a 32k x 8 cache's float32 is 1 GiB
            x = torch.randn(2, min(1024, blocks - b), BLOCK, KV_HEADS, HEAD)
            cache[:, b : b + 1024] = quantize(x) if int8 else x.half()
        caches.append(cache)
    perm = torch.randperm(blocks, dtype=torch.int32)  # scattered blocks, as a real pool's
    table = perm.view(reqs, -1).contiguous()
    return caches, table


def _measure(
    ops_by_name: dict[str, Callable[..., None]], context: int, reqs: int, rounds: int
) -> None:
    torch.manual_seed(0)
    half, table_h = _case(context, reqs, False)
    int8, table_i = _case(context, reqs, True)
    q = torch.randn(reqs, HEADS, HEAD)
    lens = torch.full((reqs,), context, dtype=torch.int32)
    toks = torch.arange(reqs)
    no_kv = torch.empty(0, KV_HEADS, HEAD)
    no_slots = torch.empty(0, dtype=torch.long)
    outs = {name: torch.empty(reqs, HEADS, HEAD) for name in ops_by_name}

    def run(name: str, i: int) -> None:
        caches, table = (half, table_h) if name == "float16" else (int8, table_i)
        ops_by_name[name](
            outs[name], q, no_kv, no_kv, caches[i % len(caches)], no_slots, table, lens, toks,
            HEAD**-0.5, 0,
        )  # fmt: skip

    for threads in (1, 2):
        torch.set_num_threads(threads)
        clock = time.thread_time if threads == 1 else time.perf_counter
        times: dict[str, list[float]] = {name: [] for name in ops_by_name}
        calls = max(2, min(20, (1 << 30) // (context * reqs * 8 * 1000)))
        for name in ops_by_name:
            run(name, 0)  # warm-up (first touch, thread pool)
        for _ in range(rounds):
            for name in ops_by_name:
                for i in range(calls):
                    t0 = clock()
                    run(name, i + 1)
                    times[name].append(clock() - t0)
        med = [statistics.median(times[name]) * 1e3 for name in ops_by_name]
        print(
            f"{context:7d} {reqs:4d} {threads:7d} | " + " ".join(f"{m:10.3f}" for m in med),
            flush=True,
        )
    torch.testing.assert_close(outs["int8 new"], outs["int8 old"], rtol=1e-4, atol=1e-5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--baseline-rev", default="main")
    parser.add_argument("--contexts", default="2048,8192,32768")
    parser.add_argument("--reqs", default="1,8")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    assert ops.available()
    ops_by_name = {
        "float16": torch.ops.kvserve.cache_and_decode_attention,
        "int8 new": torch.ops.kvserve.cache_and_decode_attention_int8,
        "int8 old": _old_op(args.baseline_rev),
    }
    print(f"{HEADS} heads, {KV_HEADS} kv heads, head {HEAD}, block {BLOCK}; ms per call, median")
    print("context reqs threads | " + " ".join(f"{name:>10}" for name in ops_by_name), flush=True)
    for reqs in [int(r) for r in args.reqs.split(",")]:
        for context in [int(c) for c in args.contexts.split(",")]:
            _measure(ops_by_name, context, reqs, args.rounds)


if __name__ == "__main__":
    main()
