"""`kvserve bench peers`: kvserve against HF transformers and llama.cpp, same GGUF, same work.

Each workload is a fixed-seed list of random-token prompts with an exact output length
(EOS ignored by every engine). Engines run one after another, never side by side, each
with a short warm-up outside the timed region; model loading is not timed. The float32
GEMM rate is measured first, and achieved useful FLOP/s (see peers_workloads.workload_flops)
is reported against it. `--sweep` runs one workload at several concurrency levels
instead (see peers_sweep), and `--plot` draws that sweep.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from kvserve.args.engine_args import EngineArgs
from kvserve.benchmarks import random_gguf
from kvserve.benchmarks.memory import format_rates, machine_read_rates, read_bound
from kvserve.benchmarks.peers_bandwidth import annotate_single_streams, weight_bytes_per_token
from kvserve.benchmarks.peers_rounds import combine_rounds
from kvserve.benchmarks.peers_sweep import (
    format_sweep_table,
    new_figure,
    parse_levels,
    plot_sweep,
    run_sweep,
    sweep_report,
)
from kvserve.benchmarks.peers_workloads import (
    KVSERVE_ENGINES,
    KVSERVE_VARIANTS,
    WORKLOADS,
    EngineResult,
    PeerRequest,
    gemm_rate,
    machine_info,
    make_requests,
    workload_flops,
)

ENGINES = (*KVSERVE_ENGINES, "hf", "llamacpp")


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_scale(text: str) -> dict[str, float]:
    """ "0.25" scales every workload; "b=0.5" or "0.25,b=0.5" scales some of them."""
    scales = dict.fromkeys(WORKLOADS, 1.0)
    for item in text.split(","):
        name, _, value = item.rpartition("=")
        for key in [name] if name else list(WORKLOADS):
            if key not in WORKLOADS:
                raise argparse.ArgumentTypeError(f"unknown workload {key!r} in --scale")
            scales[key] = float(value)
    return scales


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=EngineArgs.model, help="GGUF file or a known name")
    EngineArgs.add_cli_args(parser, with_model=False)
    random_gguf.add_cli_args(
        parser,
        "e.g. llama-3.2-1b with --workloads c: the single stream against the memory read bound",
    )
    parser.add_argument("--workloads", default="a,b,c", help="comma list of a, b, c, e")
    parser.add_argument(
        "--scale", type=parse_scale, default=parse_scale("1"),
        help="shrink request counts and lengths: 0.25, or per workload: 0.5,b=0.25",
    )  # fmt: skip
    parser.add_argument(
        "--engines", default=",".join(ENGINES), help="comma list of " + ", ".join(ENGINES)
    )
    parser.add_argument("--hf-batch-sizes", type=_int_list, default=[1, 8, 32])
    parser.add_argument(
        "--llamacpp-parallel", type=_int_list, default=[32], help="sequences per decode to try"
    )
    parser.add_argument("--gemm-size", type=int, default=2048)
    parser.add_argument(
        "--torch-threads", type=int, default=None,
        help="torch.set_num_threads for kvserve and HF (default: torch's own choice)",
    )  # fmt: skip
    parser.add_argument(
        "--sweep", type=parse_levels, default=None, metavar="C1,C2,...",
        help="concurrency levels (e.g. 1,2,4,8,16,32): output tok/s of every engine at each "
        "level on --sweep-workload, instead of the per-workload table",
    )  # fmt: skip
    parser.add_argument("--sweep-workload", default="a", choices=list(WORKLOADS))
    parser.add_argument(
        "--plot", default=None, metavar="PNG",
        help="with --sweep: draw output tok/s against concurrency here (needs matplotlib)",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="run every engine this many times, round by round; report each engine's median "
        "round and same-round ratios (for machines whose speed drifts; not with --sweep)",
    )  # fmt: skip
    parser.add_argument("--output-json", default=None, help="write the results as JSON here")
    parser.add_argument("--disable-tqdm", action="store_true")


def kvserve_engine_kwargs(args: argparse.Namespace, engine: str) -> dict[str, Any]:
    kwargs = dataclasses.asdict(EngineArgs.from_cli_args(args))
    kwargs.update(KVSERVE_VARIANTS.get(engine, {}))
    return kwargs


def kvserve_config(kwargs: dict[str, Any], batching: str) -> str:
    from kvserve.config import NO_QUANTIZATION
    from kvserve.transformers_utils.model_resolver import resolve_model

    method = kwargs.get("quantization")
    if method is None:  # the default: a GGUF file's own blocks, else float32 (config.py)
        method = "gguf" if resolve_model(kwargs.get("model")).format == "gguf" else "none"
    weights = ", float32" if method in NO_QUANTIZATION else f", {method} blocks"
    cache = kwargs.get("kv_cache_dtype", "auto")
    config = batching + weights + ("" if cache == "auto" else f", {cache} KV cache")
    if kwargs.get("speculative_config"):
        from kvserve.config import SpeculativeConfig

        spec = SpeculativeConfig.from_cli(kwargs["speculative_config"])
        draft = f" {spec.quantization or 'default'} draft" if spec.method == "draft_model" else ""
        config += f", spec {spec.method}{draft} k={spec.num_speculative_tokens}"
    return config


def run_kvserve(
    args: argparse.Namespace, workloads: dict[str, list[PeerRequest]], engine: str = "kvserve"
) -> list[EngineResult]:
    from kvserve.entrypoints.llm import LLM
    from kvserve.sampling_params import SamplingParams

    kwargs = kvserve_engine_kwargs(args, engine)
    llm = LLM(**kwargs)
    results = []
    try:
        # Warm-up tokens outside every workload's prompts, so no prefix-cache hit is created.
        llm.generate(
            {"prompt_token_ids": [100, 101, 102, 103]}, SamplingParams(max_tokens=2), use_tqdm=False
        )
        for name, requests in workloads.items():
            prompts: list[Any] = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
            params = [
                SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.output_len)
                for r in requests
            ]
            spec = _spec_decoding_totals(llm)
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
            elapsed = time.perf_counter() - start
            produced = sum(len(c.token_ids) for o in outputs for c in o.outputs)
            if produced != sum(r.output_len for r in requests):
                raise RuntimeError(f"kvserve produced {produced} tokens, not the requested count")
            results.append(
                EngineResult(
                    engine, name, elapsed, sum(len(r.prompt_token_ids) for r in requests), produced,
                    config=kvserve_config(kwargs, f"continuous batching, max_num_seqs={args.max_num_seqs}"),
                    extra=_spec_extra(spec, _spec_decoding_totals(llm)) if spec else {},
                )
            )  # fmt: skip
    finally:
        llm.llm_engine.shutdown()
    return results


def _spec_decoding_totals(llm: Any) -> tuple[int, int, int] | None:
    """(drafts, draft tokens, accepted tokens) so far of an in-process engine, or None."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    stats = None if core is None else core.scheduler.spec_decode.spec_decoding_stats
    if stats is None:
        return None
    return stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens


def _spec_extra(before: tuple[int, int, int], after: tuple[int, int, int] | None) -> dict[str, Any]:
    assert after is not None
    drafts, drafted, accepted = (a - b for a, b in zip(after, before, strict=True))
    return {
        "spec_decode_num_drafts": drafts,
        "spec_decode_acceptance_rate": accepted / drafted if drafted else 0.0,
        "spec_decode_mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
    }


def run_peers(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve.transformers_utils.arch_config import load_arch_config
    from kvserve.transformers_utils.model_resolver import resolve_model
    from kvserve.transformers_utils.tokenizer import get_tokenizer

    engines = [e for e in args.engines.split(",") if e]
    # A sweep runs one workload, with the requests `--workloads` alone would give it.
    names = [args.sweep_workload] if args.sweep else [w for w in args.workloads.split(",") if w]
    if args.plot and not args.sweep:
        raise SystemExit("--plot draws the concurrency sweep: give --sweep too")
    if args.plot:
        new_figure()  # fails now, not after the benchmark, when matplotlib is missing
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    if args.rounds > 1 and args.sweep:
        raise SystemExit("--rounds repeats the per-workload table; --sweep runs once")
    for e in engines:
        if e not in ENGINES:
            raise SystemExit(f"unknown engine {e!r}; choose from {', '.join(ENGINES)}")
    for w in names:
        if w not in WORKLOADS:
            raise SystemExit(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
    args.model = random_gguf.model_from_cli_args(args)
    resolved = resolve_model(args.model)
    arch = load_arch_config(resolved)
    special = set(get_tokenizer(resolved).all_special_ids)
    specs = {w: WORKLOADS[w].scaled(args.scale[w]) for w in names}
    workloads = {
        w: make_requests(s, arch.vocab_size, special, args.seed + i)
        for i, (w, s) in enumerate(specs.items())
    }

    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    machine = machine_info()
    machine["memory_read_gb_s"] = machine_read_rates()
    gemm = gemm_rate(args.gemm_size)
    print(_machine_line(machine, gemm), flush=True)
    notes: list[str] = []
    results: list[EngineResult] = []
    tries: list[EngineResult] = []
    sweep_runs: list[EngineResult] = []
    if args.sweep:
        w = names[0]
        sweep_runs = run_sweep(args, engines, resolved.path, w, workloads[w], notes)
    else:
        rounds = []
        for _ in range(args.rounds):
            results, round_tries = _run_table(args, engines, resolved.path, workloads, notes)
            rounds.append(results)
            tries += round_tries
        results, round_notes = combine_rounds(rounds)
        notes += round_notes
    for r in results + tries + sweep_runs:
        r.flops = workload_flops(arch, workloads[r.workload])
    machine["load_avg_after"] = machine_info()["load_avg"]
    if machine["memory_read_gb_s"]:
        # Probed again after the engines: on a shared machine the rate moves with the
        # neighbours' load, and the higher of the two is the bound (a fraction over 100%
        # then means the engine ran in a quieter moment than both probes).
        machine["memory_read_gb_s_after"] = machine_read_rates()
        bound_rates = max(
            machine["memory_read_gb_s"]["huge_pages"],
            machine["memory_read_gb_s_after"]["huge_pages"],
            key=read_bound,
        )
        single = {w for w, requests in workloads.items() if len(requests) == 1}
        notes += annotate_single_streams(
            results, single, weight_bytes_per_token(resolved.path), bound_rates
        )
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "model": resolved.path,
        "command": "kvserve bench peers " + " ".join(sys.argv[3:])
        if sys.argv[1:3] == ["bench", "peers"]
        else "",
        "machine": machine,
        "gemm_flops_per_s": gemm,
        "workloads": {w: dataclasses.asdict(s) for w, s in specs.items()},
        "results": [_result_dict(r, results, gemm) for r in results],
        "tries": [_result_dict(r, results, gemm) for r in tries],
        "notes": list(dict.fromkeys(notes)),  # rounds repeat the engines' own notes
    }
    if args.sweep:
        w = names[0]
        report["sweep"] = sweep_report(sweep_runs, args.sweep, w, len(workloads[w]))
        report["sweep"]["runs"] = _sweep_run_dicts(sweep_runs, gemm)
    return report


def _run_table(
    args: argparse.Namespace,
    engines: list[str],
    gguf_path: str,
    workloads: dict[str, list[PeerRequest]],
    notes: list[str],
) -> tuple[list[EngineResult], list[EngineResult]]:
    """Every engine on every workload: each one's best configuration, and every try."""
    progress = not args.disable_tqdm
    results: list[EngineResult] = []
    tries: list[EngineResult] = []
    for engine in engines:
        if engine in KVSERVE_ENGINES:
            results += run_kvserve(args, workloads, engine)
        elif engine == "hf":
            from kvserve.benchmarks.peers_hf import HFPeer, run_hf

            hf = HFPeer(gguf_path)
            for w, requests in workloads.items():
                best, all_tries = run_hf(gguf_path, w, requests, args.hf_batch_sizes, progress, hf)
                results.append(best)
                tries += all_tries
            del hf
        else:
            from kvserve.benchmarks.peers_llamacpp import open_llamacpp, run_llamacpp

            lcpp = open_llamacpp(gguf_path, args.torch_threads, notes)
            if lcpp is None:
                continue
            try:
                for w, requests in workloads.items():
                    best, all_tries = run_llamacpp(
                        gguf_path, w, requests, args.llamacpp_parallel, progress, lcpp
                    )
                    results.append(best)
                    tries += all_tries
            finally:
                lcpp.close()
    return results, tries


def _sweep_run_dicts(runs: list[EngineResult], gemm: float) -> list[dict[str, Any]]:
    """Every run of the sweep; its "x kvserve" is against kvserve at the same concurrency."""

    def same_level(r: EngineResult) -> list[EngineResult]:
        return [k for k in runs if k.extra["concurrency"] == r.extra["concurrency"]]

    return [_result_dict(r, same_level(r), gemm) for r in runs]


def _kvserve_rate(r: EngineResult, results: list[EngineResult]) -> float | None:
    for k in results:
        if k.engine == "kvserve" and k.workload == r.workload:
            return k.output_tok_s
    return None


def _result_dict(r: EngineResult, results: list[EngineResult], gemm: float) -> dict[str, Any]:
    base = _kvserve_rate(r, results)
    achieved = r.flops / r.elapsed_s
    return {
        "engine": r.engine,
        "workload": r.workload,
        "config": r.config,
        "elapsed_s": r.elapsed_s,
        "prompt_tokens": r.prompt_tokens,
        "output_tokens": r.output_tokens,
        "output_tok_s": r.output_tok_s,
        "total_tok_s": r.total_tok_s,
        "ratio_to_kvserve": r.output_tok_s / base if base else None,
        "achieved_gflop_s": achieved / 1e9,
        "flop_utilization": achieved / gemm,
        **r.extra,
    }


def _machine_line(m: dict[str, Any], gemm: float) -> str:
    after = m.get("memory_read_gb_s_after")
    return (
        f"machine: {m['cores']} cores, {m['cpu_model']}, flags {' '.join(m['simd_flags']) or 'none'}, "
        f"torch {m['torch_version']} with {m['torch_threads']} threads, "
        f"fp32 GEMM {gemm / 1e9:.1f} GFLOP/s, {format_rates(m.get('memory_read_gb_s') or {})}, "
        f"load avg {m['load_avg'][0]:.2f}"
        + (f"; after the runs: {format_rates(after)}" if after else "")
    )


def format_table(report: dict[str, Any]) -> str:
    header = (
        "engine",
        "workload",
        "config",
        "output tok/s",
        "total tok/s",
        "x kvserve",
        "GFLOP/s",
        "FLOP util",
    )
    rows = [
        (
            r["engine"], r["workload"], r["config"], f"{r['output_tok_s']:.1f}", f"{r['total_tok_s']:.1f}",
            "-" if r["ratio_to_kvserve"] is None else f"{r['ratio_to_kvserve']:.2f}",
            f"{r['achieved_gflop_s']:.1f}", f"{100 * r['flop_utilization']:.1f}%",
        )
        for r in sorted(report["results"], key=lambda r: (r["workload"], ENGINES.index(r["engine"])))
    ]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(
        [_machine_line(report["machine"], report["gemm_flops_per_s"]), "", *lines, *report["notes"]]
    )


def main(args: argparse.Namespace) -> int:
    report = run_peers(args)
    if "sweep" in report:
        line = _machine_line(report["machine"], report["gemm_flops_per_s"])
        print("\n".join([line, "", format_sweep_table(report["sweep"]), *report["notes"]]))
        if args.plot:
            plot_sweep(report["sweep"], line, args.plot)
            print(f"plot written to {args.plot}")
    else:
        print(format_table(report))
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
        print(f"results written to {args.output_json}")
    return 0
