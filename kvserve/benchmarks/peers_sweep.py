"""`kvserve bench peers --sweep`: output throughput against the number of concurrent
requests, on one workload, for every engine; `--plot` draws it as a PNG.

At level C every engine runs the same requests with at most C sequences in flight:
kvserve is fed at most C requests at a time (one engine for all levels, continuously
batched under that cap, which is what max_num_seqs=C does, without a model load per
level), HF generates static batches of C, and llama.cpp decodes C sequences per
llama_decode. A level above the request count runs every request at once.
"""

from __future__ import annotations

import argparse
import collections
import textwrap
import time
from typing import TYPE_CHECKING, Any

from kvserve.benchmarks.peers_workloads import KVSERVE_ENGINES, EngineResult, PeerRequest
from kvserve.outputs import RequestOutput

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from kvserve.engine.llm_engine import LLMEngine

ENGINE_LABELS = {
    "kvserve": "kvserve",
    "hf": "HF transformers",
    "llamacpp": "llama.cpp (GGUF as stored)",
}


def parse_levels(text: str) -> list[int]:
    try:
        levels = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sweep wants integers like 1,2,4: {text!r}") from None
    if not levels or levels[0] < 1:
        raise argparse.ArgumentTypeError(f"--sweep wants positive integers: {text!r}")
    return levels


def new_figure() -> Figure:
    """A matplotlib Figure drawn with Agg (files only, no display); matplotlib is optional."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise SystemExit(
            "--plot needs matplotlib: pip install 'kvserve[bench]' (or pip install matplotlib)"
        ) from None
    # Figure without pyplot: no global backend state, no GUI toolkit, Agg for savefig.
    return Figure(figsize=(7.5, 4.8))


def _generate_capped(engine: LLMEngine, requests: list[PeerRequest], limit: int, tag: str) -> int:
    """Runs every request with at most `limit` unfinished; returns the tokens produced."""
    from kvserve.sampling_params import RequestOutputKind, SamplingParams

    pending = collections.deque(enumerate(requests))
    produced = 0
    while pending or engine.has_unfinished_requests():
        # Refilled between steps, as the scheduler would admit a waiting request.
        while pending and engine.get_num_unfinished_requests() < limit:
            i, r = pending.popleft()
            params = SamplingParams(
                temperature=0.0,
                ignore_eos=True,
                max_tokens=r.output_len,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": r.prompt_token_ids}, params)
        for output in engine.step():
            if output.finished and isinstance(output, RequestOutput):
                produced += sum(len(c.token_ids) for c in output.outputs)
    return produced


def run_kvserve_sweep(
    args: argparse.Namespace,
    workload: str,
    requests: list[PeerRequest],
    levels: list[int],
    engine_name: str = "kvserve",
) -> list[EngineResult]:
    from kvserve.benchmarks.peers import kvserve_config, kvserve_engine_kwargs
    from kvserve.entrypoints.llm import LLM

    kwargs = kvserve_engine_kwargs(args, engine_name)
    # The sweep's cap is the binding one, never the engine's own.
    kwargs["max_num_seqs"] = max(kwargs["max_num_seqs"], *levels)
    llm = LLM(**kwargs)
    engine = llm.llm_engine
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    results = []
    try:
        # Warm-up tokens outside the workload's prompts, so no prefix-cache hit is created.
        _generate_capped(engine, [PeerRequest([100, 101, 102, 103], 2)], 1, "warmup")
        for level in levels:
            # Every level runs the same prompts: the previous level's cached blocks must go.
            if not engine.reset_prefix_cache():
                raise RuntimeError("kvserve could not reset its prefix cache between levels")
            start = time.perf_counter()
            produced = _generate_capped(engine, requests, level, f"sweep{level}")
            elapsed = time.perf_counter() - start
            if produced != sum(r.output_len for r in requests):
                raise RuntimeError(f"kvserve produced {produced} tokens, not the requested count")
            results.append(
                EngineResult(
                    engine_name, workload, elapsed, prompt_tokens, produced,
                    config=kvserve_config(kwargs, f"continuous batching, at most {level} in flight"),
                    extra={"concurrency": level},
                )
            )  # fmt: skip
    finally:
        engine.shutdown()
    return results


def run_sweep(
    args: argparse.Namespace,
    engines: list[str],
    gguf_path: str,
    workload: str,
    requests: list[PeerRequest],
    notes: list[str],
) -> list[EngineResult]:
    levels: list[int] = args.sweep
    progress = not args.disable_tqdm
    results: list[EngineResult] = []
    for engine in engines:
        if engine in KVSERVE_ENGINES:
            results += run_kvserve_sweep(args, workload, requests, levels, engine)
        elif engine == "hf":
            from kvserve.benchmarks.peers_hf import HFPeer

            hf = HFPeer(gguf_path)
            for level in levels:
                result = hf.run(workload, requests, level, progress)
                result.extra["concurrency"] = level
                results.append(result)
            del hf
        else:
            from kvserve.benchmarks.peers_llamacpp import open_llamacpp

            lcpp = open_llamacpp(gguf_path, args.torch_threads, notes)
            if lcpp is None:
                continue
            try:
                for level in levels:
                    result = lcpp.run(workload, requests, level, progress)
                    result.extra["concurrency"] = level
                    results.append(result)
            finally:
                lcpp.close()
    return results


def sweep_report(
    results: list[EngineResult], levels: list[int], workload: str, num_requests: int
) -> dict[str, Any]:
    """The JSON's "sweep": output tok/s per engine per level (in `concurrency` order)."""
    rates: dict[str, list[float | None]] = {}
    for r in results:
        row = rates.setdefault(r.engine, [None] * len(levels))
        row[levels.index(r.extra["concurrency"])] = r.output_tok_s
    return {
        "workload": workload,
        "num_requests": num_requests,
        "concurrency": levels,
        "output_tok_s": rates,
    }


def format_sweep_table(sweep: dict[str, Any]) -> str:
    levels = sweep["concurrency"]
    lines = [
        f"output tok/s against concurrent requests, workload {sweep['workload']} "
        f"({sweep['num_requests']} requests)",
        "",
        "| engine | " + " | ".join(f"C={c}" for c in levels) + " |",
        "|" + "---|" * (len(levels) + 1),
    ]
    for engine, rates in sweep["output_tok_s"].items():
        cells = ["-" if x is None else f"{x:.1f}" for x in rates]
        lines.append(f"| {engine} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_sweep(sweep: dict[str, Any], machine_line: str, path: str) -> None:
    """Output tok/s (y) against concurrent requests (x, log2), one line per engine."""
    from matplotlib.ticker import NullLocator

    fig = new_figure()
    ax = fig.subplots()
    levels = sweep["concurrency"]
    for engine, rates in sweep["output_tok_s"].items():
        points = [(c, x) for c, x in zip(levels, rates, strict=True) if x is not None]
        ax.plot(*zip(*points, strict=True), marker="o", label=ENGINE_LABELS.get(engine, engine))
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tok/s")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    title = (
        f"Output throughput vs concurrency, workload {sweep['workload']} "
        f"({sweep['num_requests']} requests)"
    )
    ax.set_title(title + "\n" + textwrap.fill(machine_line, 110), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
