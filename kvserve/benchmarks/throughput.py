"""`kvserve bench throughput`: offline generation speed of the LLM class on random prompts."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

from kvserve.args.engine_args import EngineArgs
from kvserve.benchmarks.datasets import sample_random_requests
from kvserve.sampling_params import SamplingParams


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=EngineArgs.model, help="GGUF file, HF directory or a known name"
    )
    EngineArgs.add_cli_args(parser, with_model=False)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--range-ratio", type=float, default=0.0)
    parser.add_argument("--output-json", default=None, help="write the results as JSON here")
    parser.add_argument("--disable-tqdm", action="store_true")


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    # Imported here: `kvserve bench serve` must not pay for torch and the engine.
    from kvserve.entrypoints.llm import LLM

    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**dataclasses.asdict(engine_args))
    try:
        requests = sample_random_requests(
            llm.get_tokenizer(),
            args.num_prompts,
            args.input_len,
            args.output_len,
            args.range_ratio,
            args.seed,
        )
        prompts: list[Any] = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        # ignore_eos: every request generates exactly its output length.
        params = [
            SamplingParams(
                temperature=1.0,
                top_p=1.0,
                ignore_eos=True,
                max_tokens=r.expected_output_len,
                seed=args.seed + i,
            )
            for i, r in enumerate(requests)
        ]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
        elapsed = time.perf_counter() - start
    finally:
        llm.llm_engine.shutdown()
    prompt_tokens = sum(len(o.prompt_token_ids or []) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        "elapsed_time": elapsed,
        "num_requests": len(outputs),
        "total_num_tokens": prompt_tokens + output_tokens,
        "total_output_tokens": output_tokens,
        "requests_per_second": len(outputs) / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
    }


def main(args: argparse.Namespace) -> int:
    result = run_throughput(args)
    print(
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['tokens_per_second']:.2f} total tokens/s, "
        f"{result['output_tokens_per_second']:.2f} output tokens/s "
        f"({result['num_requests']} requests in {result['elapsed_time']:.2f} s)"
    )
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        print(f"results written to {args.output_json}")
    return 0
