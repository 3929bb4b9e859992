"""`kvserve bench ubatch`: step time with dual batch overlap (``--enable-dbo``) vs without.

Two tensor-parallel engines (``-tp``, default 2, MultiprocExecutor) in this process, the
same but for ``enable_dbo``, run the same greedy batches in turns (each engine first
every other round), round after round, so a change in the machine's load hits both alike. Two workloads: prefill steps (long prompts,
one new token each) and decode steps (short prompts, many new tokens). For each, the
engine core's own totals give the mean step time (whole steps, and the forward alone);
the workers report how many steps ran as two micro-batches. The tokens of the two
engines must be identical. Without ``--model`` the model is a random float32 Llama
built with transformers (its size set by the flags), so no download is needed.

On a CPU the overlap is of gloo's all-reduce (a loopback TCP exchange) with the other
micro-batch's compute; with as many ranks as cores the reduction and the compute
compete for the same cores, so the gain may be small or negative: the figures say.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from typing import Any

from kvserve.benchmarks.random_hf_llama import (
    add_random_model_args,
    require_positive,
    write_random_llama,
)
from kvserve.sampling_params import SamplingParams

ENGINES = (("dbo", True), ("no_dbo", False))


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", dest="bench_model", default=None, help="HF directory or GGUF file (Llama)"
    )
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128, help="prefill workload")
    parser.add_argument("--max-tokens", type=int, default=16, help="decode workload")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--dbo-decode-token-threshold", type=int, default=32)
    parser.add_argument("--dbo-prefill-token-threshold", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per engine")
    add_random_model_args(parser, hidden_size=1024)
    parser.add_argument("--output-json", default=None, help="write the results as JSON here")


def num_ubatched_steps(worker: Any) -> int:
    """Run in each worker (collective_rpc): its steps run as micro-batches so far."""
    return int(worker.model_runner.ubatch_runner.num_ubatched_steps)


def _validate(args: argparse.Namespace) -> None:
    require_positive(
        args, "tensor_parallel_size", "num_prompts", "prompt_len", "max_tokens", "rounds"
    )


def _engine_state(llm: Any) -> tuple[Any, int]:
    """(the core's step-time totals, a copy; the workers' micro-batched steps)."""
    core = llm.llm_engine.engine_core.engine_core
    times = core.step_times
    steps = core.model_executor.collective_rpc("kvserve.benchmarks.ubatch:num_ubatched_steps")
    return (times.forward, times.busy, times.num_steps), int(steps[0])


def run_ubatch(args: argparse.Namespace) -> dict[str, Any]:
    # Imported here: `kvserve bench serve` must not pay for torch and the engine.
    from kvserve.entrypoints.llm import LLM

    _validate(args)
    rng = random.Random(0)
    engines: dict[str, Any] = {}
    results: dict[str, Any] = {
        "model": args.bench_model or "a random Llama",
        "tensor_parallel_size": args.tensor_parallel_size,
        "num_prompts": args.num_prompts,
        "thresholds": [args.dbo_decode_token_threshold, args.dbo_prefill_token_threshold],
        "load_avg_start": list(os.getloadavg()),
    }
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-ubatch-") as tmp:
        model = args.bench_model
        if model is None:
            model = os.path.join(tmp, "llama")
            write_random_llama(model, args)
        try:
            for name, on in ENGINES:
                engines[name] = LLM(
                    model,
                    skip_tokenizer_init=True,
                    tensor_parallel_size=args.tensor_parallel_size,
                    distributed_executor_backend="mp",
                    enable_dbo=on,
                    dbo_decode_token_threshold=args.dbo_decode_token_threshold,
                    dbo_prefill_token_threshold=args.dbo_prefill_token_threshold,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    max_num_seqs=max(args.num_prompts, 1),
                    enable_prefix_caching=False,  # every round computes its prompts
                    disable_log_stats=False,  # the core's step-time totals
                )
            vocab = engines["dbo"].llm_engine.config.model_config.vocab_size
            workloads = {
                "prefill": (args.prompt_len, 1),
                "decode": (8, args.max_tokens),
            }
            for workload, (prompt_len, max_tokens) in workloads.items():
                prompts = [
                    {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(prompt_len)]}
                    for _ in range(args.num_prompts)
                ]
                results[workload] = _run_workload(engines, prompts, max_tokens, args.rounds)
        finally:
            for llm in engines.values():
                llm.llm_engine.shutdown()
    results["load_avg_end"] = list(os.getloadavg())
    results["tokens_identical"] = all(results[w]["tokens_identical"] for w in workloads)
    return results


def _run_workload(
    engines: dict[str, Any], prompts: list[Any], max_tokens: int, rounds: int
) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for llm in engines.values():  # warm-up: first-call costs out of the figures
        llm.generate(prompts[:2], params, use_tqdm=False)
    totals = {name: [0.0, 0.0, 0.0, 0, 0] for name in engines}  # wall, fwd, busy, steps, ub
    round_step_ms: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list[list[int]]] = {}
    for round_index in range(rounds):
        # Each engine goes first every other round: a drift in load favours neither.
        order = list(engines.items())[:: -1 if round_index % 2 else 1]
        for name, llm in order:
            (fwd0, busy0, steps0), ub0 = _engine_state(llm)
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            (fwd1, busy1, steps1), ub1 = _engine_state(llm)
            t = totals[name]
            t[0] += wall
            t[1] += fwd1 - fwd0
            t[2] += busy1 - busy0
            t[3] += steps1 - steps0
            t[4] += ub1 - ub0
            round_step_ms[name].append(1e3 * (busy1 - busy0) / max(steps1 - steps0, 1))
            tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
    out: dict[str, Any] = {
        "max_tokens": max_tokens,
        "prompt_len": len(prompts[0]["prompt_token_ids"]),
    }
    for name, (wall, fwd, busy, steps, ubatched) in totals.items():
        out[name] = {
            "wall_s": wall,
            "steps": steps,
            "ubatched_steps": ubatched,
            "step_ms": 1e3 * busy / max(steps, 1),
            "forward_ms": 1e3 * fwd / max(steps, 1),
            "rounds_step_ms": round_step_ms[name],
        }
    out["step_speedup"] = out["no_dbo"]["step_ms"] / max(out["dbo"]["step_ms"], 1e-9)
    out["tokens_identical"] = tokens["dbo"] == tokens["no_dbo"]
    return out


def main(args: argparse.Namespace) -> int:
    r = run_ubatch(args)
    print(
        f"dual batch overlap, TP={r['tensor_parallel_size']} on {r['model']}: "
        f"{r['num_prompts']} prompts, thresholds decode {r['thresholds'][0]} / "
        f"prefill {r['thresholds'][1]} tokens"
    )
    for workload in ("prefill", "decode"):
        w = r[workload]
        print(f"  {workload} ({w['prompt_len']}-token prompts, {w['max_tokens']} new tokens):")
        for name, _ in ENGINES:
            e = w[name]
            print(
                f"    {name:<7} step {e['step_ms']:8.2f} ms (forward {e['forward_ms']:8.2f} ms)"
                f" over {e['steps']} steps, {e['ubatched_steps']} as micro-batches, "
                f"wall {e['wall_s']:.2f} s; rounds "
                + ", ".join(f"{ms:.1f}" for ms in e["rounds_step_ms"])
                + " ms/step"
            )
        print(
            f"    step time without / with DBO: {w['step_speedup']:.2f}x; "
            f"tokens identical: {w['tokens_identical']}"
        )
    print(
        f"load average: {r['load_avg_start'][0]:.2f} at the start, "
        f"{r['load_avg_end'][0]:.2f} at the end"
    )
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(r, f, indent=2)
        print(f"results written to {args.output_json}")
    return 0 if r["tokens_identical"] else 1
