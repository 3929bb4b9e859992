"""The lossless float GEMV (csrc/block_gemm.h, block_gemm_planes.h) on a 1B-shaped layer
stack of random Q4_1 blocks, next to the machine's memory read rate.

A single-stream decode step multiplies one row of x by every projection of every layer in
turn, so it streams the whole stack (16 Llama-3.2-1B layers: ~610 MB of Q4_1, far beyond
the last-level cache) from DRAM once per token. This times exactly that sequence through
`block_linear` (the weights on huge pages as the loader puts them, in nibble planes where
the build prefers them), in GB/s of weight bytes (quants, scales and minimums), on 1 and 2
threads, beside `kvserve bench memory`'s huge-page read rate measured in the same run, and
the same GEMVs on weights that stay in L3 (one layer's q/k/v and o) and in L2 (a 512-row
weight): their rate is the kernel's compute bound. The sets are interleaved round by
round so a shared machine's load falls on all of them alike; the median round is shown
with the process CPU time per GB (both threads' time: robust to other processes taking
the cores, not to the threads' spin-waits).

    PYTHONPATH=. python tools/bench_block_gemv.py --rows 1 --rounds 5

What it showed on a 2-core AMD EPYC Zen 3 VM (AVX2), loaded by other work (load 7-12), at
one thread: the stack from DRAM and the in-cache weights took the same CPU time per GB
(0.17-0.22 s/GB), so a thread is bound by the kernel's instructions, not by memory: the
plane kernel's loop is 41 instructions per pair of blocks (per 32 weights: 3.5 AND/shift,
4 conversions, 5 multiply-adds, 1 broadcast, 5.5 loop and address), ~10 cycles per pair
at best (3.5 ns, 2.8 GHz: ~11 GB/s of weight bytes per thread), against 6.5 cycles for
its 26 FP-pipe operations on Zen 3's four pipes (conversions share FP2/FP3 with adds, 2 a
cycle; multiply-adds FP0/FP1, 2 a cycle).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from kvserve import _custom_ops as ops
from kvserve.benchmarks.memory import probe_bytes, read_rates
from kvserve.utils.huge_pages import move_to_huge_pages

HIDDEN, KV, INTER = 2048, 512, 8192  # Llama-3.2-1B
Weight = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]


def _weight(n: int, k: int, gen: torch.Generator, kind: int) -> Weight:
    """A random Q4_1 weight [n, k] as the lossless path holds it (kind 1, or 5 in planes:
    the values do not matter to the speed, so random bytes stand for either layout)."""
    qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n * k // 32, generator=gen) * 0.01 + 0.001).half()
    m = (torch.rand(n * k // 32, generator=gen) * -0.1).half()
    return qs, d, m, kind


def _nbytes(w: Weight) -> int:
    return sum(t.numel() * t.element_size() for t in w[:3])


def layer_stack(layers: int, kind: int) -> list[Weight]:
    """Each layer's fused q/k/v, o, fused gate/up and down, as the decode step runs them."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    stack = [_weight(n, k, gen, kind) for _ in range(layers) for n, k in shapes]
    move_to_huge_pages(t for w in stack for t in w[:3])
    return stack


def run_set(weights: list[Weight], xs: dict[int, torch.Tensor], repeat: int) -> tuple[float, float]:
    """(GB/s of weight bytes, process CPU seconds per GB) over `repeat` passes."""
    total = sum(_nbytes(w) for w in weights) * repeat
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(repeat):
        for qs, d, m, kind in weights:
            ops.block_linear(xs[qs.shape[1] * 2], qs, d, m, kind)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return total / wall / 1e9, cpu / (total / 1e9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rows", type=int, default=1, help="rows of x (1: single stream)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    kind = 5 if ops.gemv_prefers_nibble_planes() else 1
    stack = layer_stack(args.layers, kind)
    stack_bytes = sum(_nbytes(w) for w in stack)
    l3 = stack[:2]  # one layer's q/k/v and o: ~6.5 MB
    gen = torch.Generator().manual_seed(1)
    l2 = [_weight(512, HIDDEN, gen, kind)]  # 0.66 MB: half of it per thread of two
    sets = {"dram": (stack, 1), "l3": (l3, max(1, stack_bytes // (3 * _nbytes(l3[0]) + 1)))}
    sets["l2"] = (l2, max(1, stack_bytes // _nbytes(l2[0]) // 2))
    xs = {k: torch.randn(args.rows, k) for k in (HIDDEN, INTER)}
    print(f"kind {kind}, {args.layers} layers, {stack_bytes / 1e6:.0f} MB, rows {args.rows}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in sets}
        for weights, _ in sets.values():
            run_set(weights, xs, 1)  # warm
        for _ in range(args.rounds):
            for name, (weights, repeat) in sets.items():
                results[name].append(run_set(weights, xs, repeat))
        mem = read_rates(threads, probe_bytes(), 3, True)[-1]
        parts = []
        for name, rows in results.items():
            rate = statistics.median(r for r, _ in rows)
            cpu = statistics.median(c for _, c in rows)
            best = max(r for r, _ in rows)
            parts.append(f"{name} {rate:5.1f} GB/s (best {best:5.1f}, cpu {cpu:.3f} s/GB)")
        print(f"threads {threads}: memory read {mem:5.1f} GB/s | " + " | ".join(parts))
        print(f"  load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
