"""`kvserve bench pipeline`: pipeline-parallel throughput with the batch queue vs without.

Two engines with the same pipeline stages (``-pp``, default 2, MultiprocExecutor) in the
same process: the default one keeps a micro-batch per stage in flight (the engine core's
batch queue), the other runs with ``batch_queue=False`` (one batch at a time, the stages
taking turns). They run the same greedy batch in turns, round after round, so a change
in the machine's load hits both alike; the tokens of the two must be identical. Without
``--model`` the model is a random float32 Llama built with transformers (its size set by
the flags), so no download is needed.

The default batch is prefill-heavy (64 prompts of 256 tokens, 4 new tokens each): every
micro-batch then has as many tokens as the single batch would (the token budget splits
the prompts either way), so the figures differ by the overlap alone, and there are
enough micro-batches for the pipeline to stay full between its fill and its drain. Decode steps split
into smaller micro-batches, and on a CPU a decode step of half the rows costs nearly as
much as the whole (the weights are read either way); raise --max-tokens to see that side.
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


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", dest="bench_model", default=None, help="HF directory or GGUF file (Llama)"
    )
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=4, help="new tokens per prompt")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per engine")
    add_random_model_args(parser, hidden_size=512)
    parser.add_argument("--output-json", default=None, help="write the results as JSON here")


def _validate(args: argparse.Namespace) -> None:
    require_positive(
        args, "pipeline_parallel_size", "num_prompts", "prompt_len", "max_tokens", "rounds"
    )
    if args.pipeline_parallel_size < 2:
        raise ValueError("pipeline_parallel_size must be >= 2: the batch queue needs stages")


def run_pipeline(args: argparse.Namespace) -> dict[str, Any]:
    # Imported here: `kvserve bench serve` must not pay for torch and the engine.
    from kvserve.entrypoints.llm import LLM

    _validate(args)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engines: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-pp-") as tmp:
        model = args.bench_model
        if model is None:
            model = os.path.join(tmp, "llama")
            write_random_llama(model, args)
        try:
            for name, on in (("batch_queue", True), ("no_batch_queue", False)):
                engines[name] = LLM(
                    model,
                    skip_tokenizer_init=True,
                    pipeline_parallel_size=args.pipeline_parallel_size,
                    distributed_executor_backend="mp",
                    batch_queue=on,
                    enable_prefix_caching=False,  # every round computes its prompts
                )
            vocab = engines["batch_queue"].llm_engine.config.model_config.vocab_size
            prompts = [
                {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.prompt_len)]}
                for _ in range(args.num_prompts)
            ]
            seconds: dict[str, list[float]] = {name: [] for name in engines}
            tokens: dict[str, list[list[int]]] = {}
            for llm in engines.values():  # warm-up: first-call costs out of the figures
                llm.generate(prompts[:2], params, use_tqdm=False)
            for _ in range(args.rounds):
                for name, llm in engines.items():
                    start = time.perf_counter()
                    outs = llm.generate(prompts, params, use_tqdm=False)
                    seconds[name].append(time.perf_counter() - start)
                    tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
            in_flight = {
                name: llm.llm_engine.engine_core.engine_core.max_batches_in_flight
                for name, llm in engines.items()
            }
        finally:
            for llm in engines.values():
                llm.llm_engine.shutdown()
    generated = args.num_prompts * args.max_tokens
    total = args.num_prompts * (args.prompt_len + args.max_tokens)
    results: dict[str, Any] = {
        "model": args.bench_model or "a random Llama",
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "num_prompts": args.num_prompts,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "load_avg": list(os.getloadavg()),
    }
    for name, times in seconds.items():
        results[name] = {
            "rounds_s": times,
            "requests_per_s": args.num_prompts * len(times) / sum(times),
            "total_tokens_per_s": total * len(times) / sum(times),
            "output_tokens_per_s": generated * len(times) / sum(times),
            "best_round_total_tokens_per_s": total / min(times),
            "max_batches_in_flight": in_flight[name],
        }
    # The same work in both: the ratio of the throughputs is that of the times.
    results["speedup"] = sum(seconds["no_batch_queue"]) / sum(seconds["batch_queue"])
    results["tokens_identical"] = tokens["batch_queue"] == tokens["no_batch_queue"]
    return results


def main(args: argparse.Namespace) -> int:
    r = run_pipeline(args)
    print(
        f"PP={r['pipeline_parallel_size']} on {r['model']}: {r['num_prompts']} prompts x "
        f"{r['prompt_len']} tokens, {r['max_tokens']} new tokens each (greedy)"
    )
    for key in ("batch_queue", "no_batch_queue"):
        n = r[key]["max_batches_in_flight"]
        print(
            f"  {key:<15} {r[key]['requests_per_s']:6.2f} req/s, "
            f"{r[key]['total_tokens_per_s']:8.1f} total tok/s "
            f"({r[key]['output_tokens_per_s']:.1f} output; best round "
            f"{r[key]['best_round_total_tokens_per_s']:.1f} total), "
            + (f"up to {n} micro-batches in flight" if n else "one batch at a time")
        )
    print(f"Batch queue speedup: {r['speedup']:.2f}x throughput")
    print(f"Tokens identical with and without the batch queue: {r['tokens_identical']}")
    print(f"load average at the end: {r['load_avg'][0]:.2f}")
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(r, f, indent=2)
        print(f"results written to {args.output_json}")
    return 0 if r["tokens_identical"] else 1
