"""`kvserve bench moe`: the FusedMoE layer against a per-expert Python loop and against
HF transformers' Mixtral MoE block, on the same weights.

All three compute one Mixtral-style sparse MLP (softmax router, top-k renormalised,
SiLU-gated experts): ``fused`` is kvserve's layer (tokens sorted by expert, one grouped
GEMM per projection), ``loop`` the textbook per-expert loop (for each expert: find its
tokens, gather, three matmuls, scatter-add), ``hf`` ``MixtralSparseMoeBlock`` with
``experts_implementation="eager"`` (HF's own per-expert loop) and ``hf_grouped`` with
``"grouped_mm"`` (what transformers 5 picks inside a loaded model where it can). Calls alternate round by round so a change in machine
load hits all three alike; the figure is the median time per call, and the outputs are
checked against each other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from kvserve.model_executor.layers.fused_moe import FusedMoE, select_experts
from kvserve.transformers_utils.arch_families import MoEConfig

IMPLEMENTATIONS = ("fused", "loop", "hf", "hf_grouped")


@dataclass
class MoEResult:
    num_tokens: int
    ms: dict[str, float]  # median per call, by implementation
    max_abs_diff: float  # of any implementation's output from fused's

    def ratio(self, name: str) -> float:
        """How many times longer ``name`` takes than ``fused``."""
        return self.ms[name] / self.ms["fused"]


def per_expert_loop(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, router: torch.Tensor, config: MoEConfig
) -> torch.Tensor:
    """The baseline: one pass per expert over the tokens routed to it."""
    weights, ids = select_experts(F.linear(x, router), config)
    out = torch.zeros_like(x)
    intermediate = w13.shape[1] // 2
    for expert in range(w13.shape[0]):
        token_idx, slot = torch.where(ids == expert)
        if token_idx.numel() == 0:
            continue
        rows = x[token_idx]
        gate_up = rows @ w13[expert].T
        hidden = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        out.index_add_(0, token_idx, (hidden @ w2[expert].T) * weights[token_idx, slot, None])
    return out


def _hf_block(
    layer: FusedMoE, router: torch.Tensor, hidden: int, experts_implementation: str
) -> torch.nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    c = layer.config
    config = MixtralConfig(
        hidden_size=hidden,
        intermediate_size=c.intermediate_size,
        num_local_experts=c.num_experts,
        num_experts_per_tok=c.top_k,
    )
    config._experts_implementation = experts_implementation
    block = MixtralSparseMoeBlock(config).eval()
    with torch.no_grad():
        block.gate.weight.copy_(router)
        block.experts.gate_up_proj.copy_(layer.w13_weight)
        block.experts.down_proj.copy_(layer.w2_weight)
    return block


def _median_ms(fns: Mapping[str, Callable[[], torch.Tensor]], rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


@torch.inference_mode()
def run(
    num_experts: int,
    top_k: int,
    hidden: int,
    intermediate: int,
    token_counts: list[int],
    rounds: int,
) -> list[MoEResult]:
    torch.manual_seed(0)
    config = MoEConfig(num_experts=num_experts, top_k=top_k, intermediate_size=intermediate)
    layer = FusedMoE(config, hidden).eval()
    with torch.no_grad():
        layer.w13_weight.normal_(0, hidden**-0.5)
        layer.w2_weight.normal_(0, intermediate**-0.5)
    router = torch.randn(num_experts, hidden) * hidden**-0.5
    hf = _hf_block(layer, router, hidden, "eager")
    hf_grouped = _hf_block(layer, router, hidden, "grouped_mm")
    results = []
    for num_tokens in token_counts:
        x = torch.randn(num_tokens, hidden)
        fns = {
            "fused": lambda x=x: layer.forward(x, F.linear(x, router)),
            "loop": lambda x=x: per_expert_loop(
                x, layer.w13_weight, layer.w2_weight, router, config
            ),
            "hf": lambda x=x: hf(x.unsqueeze(0))[0],
            "hf_grouped": lambda x=x: hf_grouped(x.unsqueeze(0))[0],
        }
        outs = {name: fn() for name, fn in fns.items()}  # warm-up, and the agreement check
        diff = max(float((out - outs["fused"]).abs().max()) for out in outs.values())
        results.append(MoEResult(num_tokens, _median_ms(fns, rounds), diff))
    return results


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--intermediate-size", type=int, default=1024)
    parser.add_argument("--num-tokens", type=int, nargs="+", default=[1, 8, 64, 256, 1024])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def main(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    results = run(
        args.num_experts, args.top_k, args.hidden_size, args.intermediate_size,
        args.num_tokens, args.rounds,
    )  # fmt: skip
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
        return 0
    print(
        f"MoE layer: {args.num_experts} experts, top-{args.top_k}, hidden {args.hidden_size}, "
        f"intermediate {args.intermediate_size}, {torch.get_num_threads()} threads; "
        "median ms per call (x: times fused)"
    )
    print(f"{'tokens':>7} " + " ".join(f"{name:>18}" for name in IMPLEMENTATIONS) + "  max diff")
    for r in results:
        cells = [f"{r.ms[n]:>9.3f} ({r.ratio(n):>5.2f}x)" for n in IMPLEMENTATIONS]
        print(
            f"{r.num_tokens:>7} " + " ".join(f"{c:>18}" for c in cells) + f"  {r.max_abs_diff:.1e}"
        )
    return 0
