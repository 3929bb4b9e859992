"""gguf_int8's matmuls at decode shapes: the row-interleaved copy (block_gemm_vnni.cpp /
block_gemm_packed_avx2.cpp) against the plain layout's int8 kernel (block_gemm_int8.cpp),
on random blocks (speed does not depend on the values) at SmolLM2-135M's, Gemma 3 270M's
and a Llama-3.2-1B-like model's projection and LM-head shapes.

Variants run interleaved call by call, so a shared machine's load falls on all alike.
1 thread: per-thread CPU time (time.thread_time; torch runs the call on this thread);
2 threads: wall time. Each figure is a median. Weights smaller than ``--cycle-mib`` are
cycled through several copies so that they come from memory as in a decode step (the
other layers' weights pass through the caches between two uses of one).

    PYTHONPATH=. python tools/bench_int8_gemv.py --rows 1 2 --threads 1 2
    ... --rows 1 2 3 4 8 --threads 1 --reps 300 --cycle-mib 0 --packed-only --ops qkv
    KVSERVE_MARCH=haswell ... (the AVX2 build on a CPU with AVX-512)
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from kvserve import _custom_ops as ops
from kvserve.model_executor.layers.block_weight import BlockWeight

# (model, op, out features, in features, block type)
SHAPES = [
    ("smollm2", "qkv", 960, 576, T.Q4_1),
    ("smollm2", "o", 576, 576, T.Q4_1),
    ("smollm2", "gate_up", 3072, 576, T.Q4_1),
    ("smollm2", "down", 576, 1536, T.Q4_1),
    ("smollm2", "head", 49152, 576, T.Q8_0),
    ("gemma3", "qkv", 1536, 640, T.Q8_0),
    ("gemma3", "head", 262144, 640, T.Q8_0),
    ("1b", "qkv", 3072, 2048, T.Q4_1),
    ("1b", "gate_up", 16384, 2048, T.Q4_1),
    ("1b", "down", 2048, 8192, T.Q4_1),
    ("1b", "head", 128256, 2048, T.Q8_0),
]
_BLOCK_BYTES = {T.Q8_0: 34, T.Q4_1: 20, T.Q4_0: 18}


def random_blocks(qtype: T, rows: int, cols: int, seed: int) -> BlockWeight:
    """GGUF blocks of random quants and small positive float16 scales, built directly
    (the gguf package's quantizer takes minutes at a 262k-row head)."""
    rng = np.random.default_rng(seed)
    nb, bb = cols // 32, _BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, size=(rows, nb, bb), dtype=np.uint8)
    scales = 2 if qtype == T.Q4_1 else 1
    raw[:, :, : 2 * scales] = (
        rng.uniform(1e-3, 1e-2, size=(rows, nb, scales)).astype(np.float16).view(np.uint8)
    ).reshape(rows, nb, 2 * scales)
    return BlockWeight.from_raw(raw.reshape(rows, nb * bb), qtype)


def _call_time(x: torch.Tensor, w: BlockWeight, packed: torch.Tensor | None, wall: bool) -> float:
    """Seconds of one call: this thread's CPU time, or wall time when threads share it."""
    clock = time.perf_counter if wall else time.thread_time
    start = clock()
    ops.block_linear_int8(x, w.qs, w.d, w.m, w.kind, packed)
    return clock() - start


def bench(args: argparse.Namespace) -> None:
    print(f"# {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print("# model op rows threads: ms per call, packed and plain (the int8 kernel, 1-3 rows)")
    for model, op, n, k, qtype in SHAPES:
        if (args.models and model not in args.models) or (args.ops and op not in args.ops):
            continue
        nbytes = n * k // 32 * _BLOCK_BYTES[qtype]
        copies = max(1, (args.cycle_mib << 20) // nbytes)
        weights = [random_blocks(qtype, n, k, seed=i) for i in range(copies)]
        packed = [ops.pack_blocks_vnni(w.qs, w.d, w.m, w.kind) for w in weights]
        for rows in args.rows:
            x = torch.randn(rows, k)
            for threads in args.threads:
                torch.set_num_threads(threads)
                wall = threads > 1
                variants: dict[str, list[float]] = {"packed": []}
                if rows < 4 and not args.packed_only:
                    variants["plain"] = []
                for i in range(args.reps * copies):
                    c = i % copies
                    w = weights[c]
                    for name, times in variants.items():
                        p = packed[c] if name == "packed" else None
                        times.append(_call_time(x, w, p, wall))
                # Median, and the fastest call: on a shared machine the least disturbed.
                med = {name: statistics.median(t) * 1e3 for name, t in variants.items()}
                low = {name: min(t) * 1e3 for name, t in variants.items()}
                figures = "  ".join(
                    f"{name} {med[name]:.3f} (min {low[name]:.3f})" for name in variants
                )
                ratio = ""
                if "plain" in med:
                    ratio = f"  packed/plain {med['packed'] / med['plain']:.2f}"
                    ratio += f" (min {low['packed'] / low['plain']:.2f})"
                print(
                    f"{model:8s} {op:8s} {n:6d}x{k:<5d} {qtype.name} rows={rows} t={threads}: "
                    f"{figures}{ratio}",
                    flush=True,
                )
    print(f"# {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--models", nargs="*", default=[])
    parser.add_argument("--ops", nargs="*", default=[])
    parser.add_argument("--packed-only", action="store_true", help="skip the plain layout")
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument(
        "--cycle-mib", type=int, default=96,
        help="cycle through copies of each weight totalling this much (0: one copy, which "
        "stays in the caches where it fits: the kernels' arithmetic alone)",
    )  # fmt: skip
    bench(parser.parse_args())


if __name__ == "__main__":
    main()
