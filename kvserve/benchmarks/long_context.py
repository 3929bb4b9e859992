"""`kvserve bench long-context`: decode speed with a long context, against llama.cpp.

Each stream's prompt is ``context`` random token ids (distinct per stream, so no prefix
is shared); the prompts are prefilled once, untimed, and then only the decode steps in
which every stream is decoding count: output tokens per second at that context. A long
context makes decode attention-bound (each step reads the whole KV cache), which is what
the kernel's split-K serves: one long request's context spread over the cores.

The model must hold the context: a GGUF whose ``context_length`` is shorter (the packaged
SmolLM2-135M holds 8192 positions) is copied once with the key raised, and positions past
the trained length extrapolate its RoPE; ``--random-gguf`` takes a random-weight model
at a real shape (Llama 3.2 1B, ...) with 131072 positions instead. The tokens are random
anyway: this measures speed, not what the model says. llama.cpp (llama-cpp-python, when installed) runs the same
GGUF in the same run, its ``n_ctx`` set to fit every stream.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import time
from typing import Any

from kvserve.args.engine_args import EngineArgs
from kvserve.benchmarks import random_gguf
from kvserve.benchmarks.long_context_gguf import gguf_with_context
from kvserve.benchmarks.long_context_llamacpp import llamacpp_decode_rate
from kvserve.benchmarks.peers_llamacpp import extra_buffer_types_run, llama_cpp_available

LLAMACPP_MISSING = "llama.cpp not installed (pip install llama-cpp-python)"
# A token per llama_decode costs a decode step each: 8,192 of SmolLM2's took 8 minutes on
# an Intel Xeon, so longer prompts go in batches.
_TOKEN_AT_A_TIME_PROMPTS = 8192


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=EngineArgs.model, help="GGUF file or a known name (a GGUF model)"
    )
    EngineArgs.add_cli_args(parser, with_model=False)
    random_gguf.add_cli_args(parser, "131072 positions")
    parser.add_argument(
        "--contexts", type=_int_list, default=[8192, 32768], help="context tokens per stream"
    )
    parser.add_argument("--streams", type=_int_list, default=[1, 8], help="concurrent streams")
    parser.add_argument("--output-len", type=int, default=32, help="decode tokens per stream")
    parser.add_argument(
        "--engines", default="kvserve,llamacpp", help="comma list of kvserve, llamacpp"
    )
    parser.add_argument(
        "--torch-threads", type=int, default=None,
        help="torch.set_num_threads for kvserve, and llama.cpp's threads (default: all cores)",
    )  # fmt: skip
    parser.add_argument("--output-json", default=None, help="write the results as JSON here")


def random_prompts(vocab_size: int, context: int, streams: int, seed: int) -> list[list[int]]:
    """``streams`` prompts of ``context`` random ids, clear of the low (special) ids."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size) for _ in range(context)] for _ in range(streams)]


def kvserve_decode_rate(
    llm: Any, prompts: list[list[int]], output_len: int, tag: str
) -> dict[str, float]:
    """Prefill every prompt, then ``output_len`` tokens each; only the steps in which every
    stream decodes are timed."""
    from kvserve.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=output_len + 1, ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )  # fmt: skip
    engine = llm.llm_engine
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params)
    started: set[str] = set()
    step_s: list[float] = []
    tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        timed = len(started) == len(prompts)  # every stream past its prefill
        t0 = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - t0
        produced = 0
        for o in outputs:
            if o.outputs and o.outputs[0].token_ids:
                started.add(o.request_id)
                produced += len(o.outputs[0].token_ids)
        if timed and produced:
            step_s.append(elapsed)
            tokens += produced
    total = time.perf_counter() - start
    if not step_s:
        raise RuntimeError("no decode step ran with every stream decoding")
    return {
        "decode_tok_s": tokens / sum(step_s),
        "median_step_ms": statistics.median(step_s) * 1e3,
        "decode_steps": len(step_s),
        "prefill_s": total - sum(step_s),
    }


def run_long_context(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve.transformers_utils.arch_config import load_arch_config
    from kvserve.transformers_utils.model_resolver import resolve_model

    engines = [e for e in args.engines.split(",") if e]
    for e in engines:
        if e not in ("kvserve", "llamacpp"):
            raise SystemExit(f"unknown engine {e!r}; choose from kvserve, llamacpp")
    if args.output_len < 2 or min(args.contexts) < 1 or min(args.streams) < 1:
        raise SystemExit("output_len must be at least 2, contexts and streams at least 1")
    args.model = random_gguf.model_from_cli_args(args)
    resolved = resolve_model(args.model)
    if resolved.format != "gguf":
        raise SystemExit(f"{args.model!r} is not a GGUF model (llama.cpp runs the same file)")
    longest = max(args.contexts) + args.output_len + 1
    gguf_path = gguf_with_context(resolved.path, longest)
    arch = load_arch_config(resolve_model(gguf_path))
    threads = args.torch_threads or os.cpu_count() or 1
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    from kvserve import _custom_ops as ops

    notes: list[str] = []
    if gguf_path != resolved.path:
        notes.append(f"context_length raised to {longest} in a copy: {gguf_path}")
    if "llamacpp" in engines and not llama_cpp_available():
        notes.append(LLAMACPP_MISSING)
        print(LLAMACPP_MISSING, flush=True)
        engines.remove("llamacpp")
    llamacpp_options = (
        _llamacpp_options(gguf_path, threads, args, notes) if "llamacpp" in engines else {}
    )
    results: list[dict[str, Any]] = []
    for context in args.contexts:
        # One kvserve engine per context, sized for the most streams, serves every count.
        llm = _kvserve_engine(args, gguf_path, context) if "kvserve" in engines else None
        try:
            for streams in args.streams:
                seed = args.seed + context + 1000 * streams  # no prefix shared across runs
                prompts = random_prompts(arch.vocab_size, context, streams, seed)
                row: dict[str, Any] = {"context": context, "streams": streams}
                if ops.available():
                    row["split_k_partitions"] = ops.decode_attention_partitions(context)
                if llm is not None:
                    row["kvserve"] = kvserve_decode_rate(llm, prompts, args.output_len, "long")
                if "llamacpp" in engines:
                    row["llamacpp"] = llamacpp_decode_rate(
                        gguf_path, prompts, args.output_len, threads, **llamacpp_options
                    )
                if "kvserve" in row and "llamacpp" in row:
                    ratio = row["kvserve"]["decode_tok_s"] / row["llamacpp"]["decode_tok_s"]
                    row["ratio"] = ratio
                print(format_row(row), flush=True)
                results.append(row)
        finally:
            if llm is not None:
                llm.llm_engine.shutdown()
    return {
        "model": args.model,
        "gguf": gguf_path,
        "kv_cache_dtype": args.kv_cache_dtype,
        "output_len": args.output_len,
        "threads": threads,
        "load_avg": list(os.getloadavg()),
        "results": results,
        "notes": notes,
    }


def _llamacpp_options(
    gguf_path: str, threads: int, args: argparse.Namespace, notes: list[str]
) -> dict[str, Any]:
    """How llama.cpp runs here. Prompts (and several streams' decode steps) go to it in
    batches, which its AMX tile kernels serve, and on a VM whose CPU advertises AMX
    without running it they kill the process. There a single stream's prompt goes a token
    per llama_decode (its matrix-vector kernels, its fastest decode on such a machine, as
    `bench peers`' single stream) up to _TOKEN_AT_A_TIME_PROMPTS tokens; other runs, and
    every run where even that crashes, go without the extra buffer types."""
    if extra_buffer_types_run(gguf_path, threads):
        return {}
    crashed = "llama.cpp: its extra CPU buffer types (AMX, repacking) crashed a probe decode"
    single = max(args.streams) == 1 and max(args.contexts) <= _TOKEN_AT_A_TIME_PROMPTS
    if single and extra_buffer_types_run(gguf_path, threads, tokens_per_decode=1):
        notes.append(f"{crashed}; prompts go a token per llama_decode (untimed), decode keeps them")
        options: dict[str, Any] = {"prefill_tokens_per_decode": 1}
    else:
        notes.append(f"{crashed}; it runs without them (use_extra_bufts off)")
        options = {"extra_buffer_types": False}
    print(notes[-1], flush=True)
    return options


def _kvserve_engine(args: argparse.Namespace, gguf_path: str, context: int) -> Any:
    from kvserve.entrypoints.llm import LLM

    per_seq = context + args.output_len + 1
    streams = max(args.streams)
    blocks = -(-per_seq // args.block_size) * streams + 4
    config = dataclasses.replace(
        EngineArgs.from_cli_args(args), model=gguf_path, max_model_len=per_seq,
        max_num_seqs=max(args.max_num_seqs, streams),
        num_blocks_override=args.num_blocks_override or blocks,
    )  # fmt: skip
    llm = LLM(**dataclasses.asdict(config))
    llm.generate({"prompt_token_ids": [100, 101, 102]}, use_tqdm=False)  # kernels loaded
    return llm


def format_row(row: dict[str, Any]) -> str:
    parts = [f"context {row['context']:>6} x{row['streams']:<2}"]
    if "split_k_partitions" in row:
        parts.append(f"split-K {row['split_k_partitions']}")
    for engine in ("kvserve", "llamacpp"):
        if engine in row:
            r = row[engine]
            parts.append(
                f"{engine} {r['decode_tok_s']:7.1f} tok/s (prefill {r['prefill_s']:.0f} s)"
            )
    if "ratio" in row:
        parts.append(f"kvserve/llama.cpp {row['ratio']:.2f}x")
    return "  ".join(parts)


def main(args: argparse.Namespace) -> int:
    report = run_long_context(args)
    for note in report["notes"]:
        print(f"note: {note}")
    print(
        f"decode tok/s after a prefill of each context, {report['output_len']} tokens per "
        f"stream, {report['threads']} threads, kvserve KV cache {report['kv_cache_dtype']}, "
        f"load average {report['load_avg'][0]:.2f}"
    )
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
        print(f"results written to {args.output_json}")
    return 0
