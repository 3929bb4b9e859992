"""The lossless digit matmul (csrc/block_gemm_exact.cpp, interleaved kinds) against the
float GEMV (csrc/block_gemm.h, in nibble planes where the build prefers them) on the same
random Q4_1 / Q4_0 blocks: CPU time per call on one thread at SmolLM2-135M's and a 1B
model's layer shapes, for a few rows of x. Rounds alternate the two kernels so a shared
machine's load falls on both alike; the median round is shown. The weights stay in cache
between calls (the 1B's largest is 10.5 MB of Q4_1): the kernels' compute bound.

    PYTHONPATH=. KVSERVE_MARCH=haswell python tools/bench_digit_matmul.py

KVSERVE_MARCH=haswell builds the AVX2 kernels on any x86-64 CPU; an AVX-512 CPU runs them
on its own (wider) pipes, so its ratios stand in for an AVX2-only CPU's only roughly.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from gguf import GGMLQuantizationType as T

from kvserve import _custom_ops as ops
from kvserve.model_executor.layers.block_weight import BlockWeight

# (outputs, inputs): SmolLM2-135M's gate/up and down, a 1B's (Llama-3.2-1B) up and down
SHAPES = [(1536, 576), (576, 1536), (8192, 2048), (2048, 8192)]
TYPES = {"Q4_1": T.Q4_1, "Q4_0": T.Q4_0}


def _weights(qtype: T, n: int, k: int) -> tuple[BlockWeight, BlockWeight]:
    """The same random blocks as the digit matmul and the float GEMV hold them."""
    gen = torch.Generator().manual_seed(n + k)
    qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n * k // 32, generator=gen) * 0.01 + 0.001).half()
    m = (torch.rand(n * k // 32, generator=gen) * -0.1).half() if qtype == T.Q4_1 else d[:0]
    digit = BlockWeight(qtype, qs.clone(), d.clone(), m.clone())
    digit.use_interleaved()
    gemv = BlockWeight(qtype, qs, d, m)
    if ops.gemv_prefers_nibble_planes():
        gemv.use_nibble_planes()
    return digit, gemv


def _cpu_per_call(weight: BlockWeight, x: torch.Tensor, calls: int) -> float:
    cpu = time.process_time()
    for _ in range(calls):
        weight.linear(x)
    return (time.process_time() - cpu) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--types", nargs="+", default=list(TYPES), choices=list(TYPES))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=0.1, help="per kernel and round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"digit matmul kinds {sorted(ops.exact_packed_kinds())}; ms CPU per call, one thread")
    for name in args.types:
        for n, k in SHAPES:
            digit, gemv = _weights(TYPES[name], n, k)
            if not digit.interleaved:
                print(f"{name} {n}x{k}: no digit matmul for kind {digit.kind} in this build")
                continue
            for rows in args.rows:
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
                assert torch.allclose(digit.linear(x), gemv.linear(x), rtol=1e-4, atol=1e-3)
                calls = max(1, int(args.seconds / max(_cpu_per_call(gemv, x, 1), 1e-6)))
                times: dict[str, list[float]] = {"digit": [], "gemv": []}
                for _ in range(args.rounds):
                    times["digit"].append(_cpu_per_call(digit, x, calls))
                    times["gemv"].append(_cpu_per_call(gemv, x, calls))
                t_digit, t_gemv = (statistics.median(times[key]) for key in ("digit", "gemv"))
                print(
                    f"{name} {n:5d}x{k:<5d} rows {rows:3d}: digit (kind {digit.kind}) "
                    f"{t_digit * 1e3:7.3f}  gemv (kind {gemv.kind}) {t_gemv * 1e3:7.3f}  "
                    f"gemv/digit {t_gemv / t_digit:5.2f}x"
                )


if __name__ == "__main__":
    main()
