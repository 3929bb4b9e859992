"""`kvserve bench cascade`: decode throughput with cascade attention on vs off.

One batch of requests sharing a long prefix (an inventory text) plus a distinct short
question each, greedy, on two engines in the same process: the default one and one with
``disable_cascade_attn``. The engines take turns step by step (so a change in the
machine's load hits both alike), and each step is timed: the first step of a batch
prefills (the prefix a cache hit after the warm-up), every later one is a pure decode
step of all the requests, and those make the decode throughput. The tokens of the two
engines are compared too.

The cascade engine runs inside ``cascade.forced()``: the batch takes the cascade path
even where the cost rule would leave it row by row (the default batch is such a one);
the rule's own choice for the batch is reported beside the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import time
from typing import Any

from kvserve.args.engine_args import EngineArgs
from kvserve.sampling_params import RequestOutputKind, SamplingParams

_COLORS = ("red", "green", "blue", "amber")


def shared_prefix_prompts(tokenizer: Any, num_requests: int, prefix_len: int) -> list[list[int]]:
    """``num_requests`` token-id prompts: the same ``prefix_len`` tokens of an inventory,
    then a question about a different item each."""
    prefix: list[int] = []
    i = 0
    while len(prefix) < prefix_len:
        i += 1
        line = (
            f"Item {i}: the {_COLORS[i % 4]} box on shelf {i % 7} holds {i * 3 % 11} "
            f"apples and {i * 5 % 13} pears; it was last checked on day {i * 7 % 31}.\n"
        )
        prefix += tokenizer.encode(line, add_special_tokens=False)
    prefix = prefix[:prefix_len]
    return [
        prefix
        + tokenizer.encode(
            f"\nQuestion {r}: how many pears does item {r + 1} hold, and on which shelf?",
            add_special_tokens=False,
        )
        for r in range(num_requests)
    ]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=EngineArgs.model, help="GGUF file, HF directory or a known name"
    )
    EngineArgs.add_cli_args(parser, with_model=False)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prefix-len", type=int, default=1000, help="shared prefix tokens")
    parser.add_argument("--output-len", type=int, default=32, help="new tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the best counts")
    parser.add_argument("--output-json", default=None, help="write the results as JSON here")


def _add_batch(llm: Any, prompts: list[list[int]], max_tokens: int, tag: str) -> None:
    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    for i, ids in enumerate(prompts):
        llm.llm_engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params)


def _run_in_turns(
    engines: dict[str, Any], prompts: list[list[int]], max_tokens: int, tag: str
) -> tuple[dict[str, list[float]], dict[str, list[list[int]]]]:
    """One batch on every engine, a step of each in turn: (decode step seconds, tokens)."""
    from kvserve.attention.backends.cascade import forced

    steps: dict[str, list[float]] = {name: [] for name in engines}
    finished: dict[str, dict[str, list[int]]] = {name: {} for name in engines}
    for llm in engines.values():
        _add_batch(llm, prompts, max_tokens, tag)
    while any(llm.llm_engine.has_unfinished_requests() for llm in engines.values()):
        for name, llm in engines.items():
            if not llm.llm_engine.has_unfinished_requests():
                continue
            with forced() if name == "cascade_on" else contextlib.nullcontext():
                start = time.perf_counter()
                outputs = llm.llm_engine.step()
                steps[name].append(time.perf_counter() - start)
            for o in outputs:
                if o.finished:
                    finished[name][o.request_id] = list(o.outputs[0].token_ids)
    tokens = {
        name: [done[f"{tag}-{i}"] for i in range(len(prompts))] for name, done in finished.items()
    }
    return {name: times[1:] for name, times in steps.items()}, tokens


def run_cascade(args: argparse.Namespace) -> dict[str, Any]:
    # Imported here: `kvserve bench serve` must not pay for torch and the engine.
    from kvserve import _custom_ops as ops
    from kvserve.attention.backends.cascade import use_cascade_attention
    from kvserve.entrypoints.llm import LLM

    if args.output_len < 2 or args.repeats < 1:
        raise ValueError("output_len must be at least 2 and repeats at least 1")
    engine_args = EngineArgs.from_cli_args(args)
    names = {"cascade_on": False, "cascade_off": True}
    engines: dict[str, Any] = {}
    try:
        for name, disabled in names.items():
            config = dataclasses.replace(engine_args, disable_cascade_attn=disabled)
            engines[name] = LLM(**dataclasses.asdict(config))
        tokenizer = engines["cascade_on"].get_tokenizer()
        prompts = shared_prefix_prompts(tokenizer, args.num_requests, args.prefix_len)
        _run_in_turns(engines, prompts, 2, "warmup")  # the prefix cached, kernels loaded
        times: dict[str, list[float]] = {name: [] for name in engines}
        tokens: dict[str, list[list[int]]] = {}
        for r in range(args.repeats):
            steps, tokens = _run_in_turns(engines, prompts, args.output_len, f"run{r}")
            for name in engines:
                times[name] += steps[name]
    finally:
        for llm in engines.values():
            llm.llm_engine.shutdown()
    results: dict[str, Any] = {
        "num_requests": args.num_requests,
        "prefix_len": args.prefix_len,
        "output_len": args.output_len,
        "load_avg": list(os.getloadavg()),
        # What the cost rule alone decides for this batch (whole blocks of the prefix).
        "cost_rule_chooses_cascade": use_cascade_attention(
            args.prefix_len // args.block_size * args.block_size,
            args.num_requests,
            vs_decode_kernel=ops.available() and args.device != "cuda",
        ),
        "decode_kernel": ops.available(),
    }
    for name, seconds in times.items():
        results[name] = {
            "decode_steps": len(seconds),
            "median_step_s": statistics.median(seconds),
            "decode_tokens_per_s": args.num_requests * len(seconds) / sum(seconds),
        }
    results["speedup"] = (
        results["cascade_on"]["decode_tokens_per_s"] / results["cascade_off"]["decode_tokens_per_s"]
    )
    results["tokens_identical"] = tokens["cascade_on"] == tokens["cascade_off"]
    return results


def main(args: argparse.Namespace) -> int:
    r = run_cascade(args)
    print(
        f"{r['num_requests']} requests sharing a {r['prefix_len']}-token prefix, "
        f"{r['output_len']} new tokens each (greedy)"
    )
    for key in ("cascade_on", "cascade_off"):
        print(
            f"  {key:<12} decode {r[key]['decode_tokens_per_s']:8.1f} tok/s, "
            f"median step {r[key]['median_step_s'] * 1e3:.1f} ms ({r[key]['decode_steps']} steps)"
        )
    print(f"Cascade speedup: {r['speedup']:.2f}x decode throughput")
    chosen = "cascade" if r["cost_rule_chooses_cascade"] else "row by row"
    print(f"The cost rule alone runs this batch {chosen}")
    print(f"Tokens identical with cascade on and off: {r['tokens_identical']}")
    print(f"load average at the end: {r['load_avg'][0]:.2f}")
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(r, f, indent=2)
        print(f"results written to {args.output_json}")
    return 0 if r["tokens_identical"] else 1
