"""`kvserve bench quantization`: what each --quantization method costs in accuracy.

Greedy continuations of a fixed prompt set under each method are compared token by token
with the float32 engine's. Prompts run one at a time (single-stream decode) and all
together (batched decode). Free-running, one flip at a near tie changes the rest of a
continuation, so a teacher-forced figure is reported too: fed float32's continuation as
its prompt, the share of steps where the method's own top token is float32's.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvserve.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS

# --methods also takes "none" (float32 weights), to measure --kv-cache-dtype on its own.
METHODS = (*QUANTIZATION_METHODS, "none")

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics are",
    "Translate to German: Good morning, how are you today?",
    "List the planets of the solar system in order:",
    "Water boils at a lower temperature on a mountain because",
    "The best way to learn a new programming language is",
    "SELECT name, age FROM users WHERE",
    "In machine learning, overfitting means",
    "A recipe for pancakes: first,",
    "The French Revolution began in",
    "import numpy as np\n\ndef normalize(v):",
    "Photosynthesis is the process by which",
    "Dear hiring manager, I am writing to apply for",
    "The difference between a list and a tuple in Python is",
)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model (default: the embedded default)")
    parser.add_argument(
        "--methods", default=",".join(QUANTIZATION_METHODS),
        help="comma-separated --quantization methods (or none) to compare with float32",
    )  # fmt: skip
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
        help="KV cache of the compared engines (the float32 reference keeps its own)",
    )  # fmt: skip
    parser.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--output-json", default=None)


def agreement(reference: list[list[int]], got: list[list[int]]) -> dict[str, float]:
    """Share of positions with the same token, prompts identical throughout, and the mean
    length of the common prefix (after a first difference greedy decoding drifts)."""
    same = total = identical = prefix = 0
    for ref, out in zip(reference, got, strict=True):
        same += sum(a == b for a, b in zip(ref, out, strict=False))
        total += len(ref)
        identical += ref == out
        prefix += next(
            (i for i, (a, b) in enumerate(zip(ref, out, strict=False)) if a != b), len(ref)
        )
    n = max(len(reference), 1)
    return {
        "position_agreement": same / max(total, 1),
        "identical_prompts": identical,
        "mean_common_prefix": prefix / n,
    }


def _continuations(
    method: str | None,
    args: argparse.Namespace,
    forced: list[list[int]] | None = None,
    kv_cache_dtype: str = "auto",
) -> dict[str, Any]:
    from kvserve.entrypoints.llm import LLM
    from kvserve.sampling_params import SamplingParams

    kwargs: dict[str, Any] = {"quantization": method, "kv_cache_dtype": kv_cache_dtype}
    if args.model:
        kwargs["model"] = args.model
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = list(PROMPTS[: args.num_prompts])
    results: dict[str, Any] = {}
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results["batched"] = [list(o.outputs[0].token_ids) for o in outputs]
        results["single_stream"] = [
            list(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts
        ]
        prompt_ids = [list(o.prompt_token_ids or []) for o in outputs]
        # The reference is fed its own continuation: its logprobs are what others' differ from.
        agree, logprobs = teacher_forced(
            llm, prompt_ids, results["batched"] if forced is None else forced
        )
        results["teacher_forced"], results["forced_logprobs"] = agree, logprobs
    finally:
        llm.llm_engine.shutdown()
    return results


def teacher_forced_agreement(
    llm: Any, prompt_ids: list[list[int]], forced: list[list[int]]
) -> float:
    """Share of the ``forced`` continuations' tokens that are the engine's top choice when
    the continuation is part of the prompt."""
    return teacher_forced(llm, prompt_ids, forced)[0]


def teacher_forced(
    llm: Any, prompt_ids: list[list[int]], forced: list[list[int]]
) -> tuple[float, list[float]]:
    """``teacher_forced_agreement`` and each forced token's logprob, in order."""
    from kvserve.sampling_params import SamplingParams

    outputs = llm.generate(
        [{"prompt_token_ids": p + f} for p, f in zip(prompt_ids, forced, strict=True)],
        SamplingParams(max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
    )
    chosen = [
        output.prompt_logprobs[len(prompt) + step][token]
        for prompt, continuation, output in zip(prompt_ids, forced, outputs, strict=True)
        for step, token in enumerate(continuation)
    ]
    agree = sum(c.rank == 1 for c in chosen) / max(len(chosen), 1)
    return agree, [c.logprob for c in chosen]


def run(args: argparse.Namespace) -> dict[str, Any]:
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"--methods: unknown quantization {unknown}; known: {METHODS}")
    if not 1 <= args.num_prompts <= len(PROMPTS):
        raise ValueError(f"--num-prompts must be in [1, {len(PROMPTS)}], got {args.num_prompts}")
    reference = _continuations("none", args)
    results: dict[str, Any] = {
        "prompts": args.num_prompts,
        "tokens_per_prompt": args.max_tokens,
        "kv_cache_dtype": args.kv_cache_dtype,
    }
    modes = ("single_stream", "batched")
    for method in methods:
        got = _continuations(method, args, reference["batched"], args.kv_cache_dtype)
        results[method] = {mode: agreement(reference[mode], got[mode]) for mode in modes}
        results[method]["teacher_forced"] = got["teacher_forced"]
        # How far the method moves float32's own tokens' logprobs (nats), fed that text.
        deltas = [
            abs(a - b)
            for a, b in zip(got["forced_logprobs"], reference["forced_logprobs"], strict=True)
        ]
        results[method]["logprob_delta"] = {
            "mean": sum(deltas) / max(len(deltas), 1),
            "max": max(deltas, default=0.0),
        }
    return results


def format_table(results: dict[str, Any]) -> str:
    lines = [
        f"greedy agreement with float32, {results['prompts']} prompts x "
        f"{results['tokens_per_prompt']} tokens, KV cache {results.get('kv_cache_dtype', 'auto')}",
        f"{'method':<11} {'mode':<14} {'positions':>9} {'identical':>9} {'common prefix':>13}"
        f" {'teacher-forced':>14} {'|dlogprob| mean/max':>20}",
    ]
    for method, modes in results.items():
        if not isinstance(modes, dict):
            continue
        for mode in ("single_stream", "batched"):
            a = modes[mode]
            lines.append(
                f"{method:<11} {mode:<14} {a['position_agreement']:>9.1%} "
                f"{a['identical_prompts']:>5}/{results['prompts']:<3} {a['mean_common_prefix']:>13.1f}"
                f" {modes['teacher_forced']:>14.1%}"
                + (f" {_delta(modes['logprob_delta']):>20}" if "logprob_delta" in modes else "")
            )
    return "\n".join(lines)


def _delta(delta: dict[str, float]) -> str:
    return f"{delta['mean']:.4f}/{delta['max']:.3f}"


def main(args: argparse.Namespace) -> int:
    results = run(args)
    print(format_table(results))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
