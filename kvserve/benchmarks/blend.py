"""`kvserve bench blend`: CacheBlend on a RAG-shaped workload, against full prefill and
prefix caching.

Workload: a pool of documents (300-800 tokens each by default); each prompt is a short
system text, k documents drawn from the pool in a shuffled order and a question, joined
by the blend separator (LMCache's " # # "). Every engine first sees each document alone
(system text + document), as a RAG store would be filled; then the prompts run.

Reported per configuration: the median over prompts of each prompt's TTFT (the fastest of
--repeats one-token generate() calls, wall time);
for CacheBlend at each recompute ratio also the agreement with full prefill: the greedy
token match rate over the first --gen-tokens tokens (position by position), how often
the first token is the same, and the KL divergence KL(full || blend) of the first
token's distribution over the whole vocabulary. At ratio 1.0 the output is exactly full
prefill's (match 1.0, KL 0).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from kvserve.args.engine_args import EngineArgs
from kvserve.benchmarks.kvcache import make_document_ids
from kvserve.sampling_params import SamplingParams

SYSTEM = "You answer questions using only the documents below."
QUESTIONS = (
    "Which of the documents mentions a harbor first?",
    "Summarise the second document in one sentence.",
    "What do the documents have in common?",
    "Which word appears most often across the documents?",
    "List three places the documents describe.",
    "Is any document about the weather?",
)


@dataclass
class Workload:
    separator: list[int]
    system: list[int]
    docs: list[list[int]]
    prompts: list[list[int]]
    reordered: int  # prompts whose documents some earlier prompt had in another order


def _join(parts: list[list[int]], separator: list[int]) -> list[int]:
    ids: list[int] = []
    for i, part in enumerate(parts):
        ids += part if i == 0 else [*separator, *part]
    return ids


def make_workload(args: argparse.Namespace, tokenizer: Any | None) -> Workload:
    rng = random.Random(args.seed)
    lengths = [rng.randint(args.min_doc_tokens, args.max_doc_tokens) for _ in range(args.pool)]
    if tokenizer is None:  # a model without a tokenizer: random ids (separator excluded)
        separator = [int(t) for t in args.separator_ids.split(",")]
        allowed = [t for t in range(5, args.vocab_size) if t not in separator]
        system = [rng.choice(allowed) for _ in range(8)]
        docs = [[rng.choice(allowed) for _ in range(n)] for n in lengths]
        questions = [[rng.choice(allowed) for _ in range(12)] for _ in QUESTIONS]
    else:
        separator = list(tokenizer.encode(args.separator, add_special_tokens=False))
        system = list(tokenizer.encode(SYSTEM, add_special_tokens=False))
        docs = [make_document_ids(tokenizer, n, seed=args.seed * 1000 + i) for i, n in enumerate(lengths)]  # fmt: skip
        questions = [list(tokenizer.encode(q, add_special_tokens=False)) for q in QUESTIONS]
    prompts, seen, reordered = [], set(), 0
    for i in range(args.num_prompts):
        chosen = rng.sample(range(args.pool), args.docs_per_prompt)
        rng.shuffle(chosen)
        key = frozenset(chosen)
        reordered += key in seen
        seen.add(key)
        parts = [system] + [docs[d] for d in chosen] + [questions[i % len(questions)]]
        prompts.append(_join(parts, separator))
    return Workload(separator, system, docs, prompts, reordered)


def _llm(args: argparse.Namespace, prefix_caching: bool, blend: bool) -> Any:
    from kvserve.entrypoints.llm import LLM

    kwargs: dict[str, Any] = {
        "kv_cache_memory": args.kv_cache_memory,
        "enable_prefix_caching": prefix_caching,
        "max_logprobs": -1,
        # One step per prompt: CacheBlend runs on a prompt's whole prefill.
        "max_num_batched_tokens": max(args.max_num_batched_tokens, 8192),
    }
    if args.separator_ids:
        kwargs["skip_tokenizer_init"] = True
    if blend:
        extra: dict[str, Any] = {"enable_blending": True, "blend_special_str": args.separator}
        if args.separator_ids:
            extra["blend_separator_ids"] = args.separator_ids
        kwargs["kv_transfer_config"] = {
            "kv_connector": "TieredCacheConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    return LLM(args.model, **kwargs)


def _params(max_tokens: int, ratio: float | None, logprobs: int | None = None) -> SamplingParams:
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs
    )
    if ratio is not None:
        params.extra_args = {"kv_transfer_params": {"blend_recompute_ratio": ratio}}
    return params


def _generate(llm: Any, ids: list[int], params: SamplingParams) -> Any:
    return llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]


def _measure(
    llm: Any, args: argparse.Namespace, work: Workload, ratio: float | None, repeats: int
) -> dict:
    """TTFT, greedy tokens and the first token's log-probabilities of every prompt."""
    ttfts, tokens, firsts = [], [], []
    for ids in work.prompts:
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            _generate(llm, ids, _params(1, ratio))
            runs.append(time.perf_counter() - t0)
        ttfts.append(min(runs))  # the least disturbed run (a shared machine is noisy)
        tokens.append(list(_generate(llm, ids, _params(args.gen_tokens, ratio)).token_ids))
        first = _generate(llm, ids, _params(1, ratio, logprobs=-1)).logprobs[0]
        firsts.append({t: lp.logprob for t, lp in first.items()})
    return {"ttft_s": statistics.median(ttfts), "tokens": tokens, "first_logprobs": firsts}


def _warm(llm: Any, work: Workload) -> None:
    """Each document alone after the system text: what a RAG store's ingest would run."""
    for doc in work.docs:
        _generate(llm, _join([work.system, doc, []], work.separator), _params(1, None))


def kl_divergence(p_log: dict[int, float], q_log: dict[int, float]) -> float:
    """KL(p || q) of two full-vocabulary log-probability maps (nats)."""
    return sum(math.exp(lp) * (lp - q_log.get(t, -math.inf)) for t, lp in p_log.items())


def agreement(reference: dict, got: dict) -> dict[str, float]:
    pairs = list(zip(reference["tokens"], got["tokens"], strict=True))
    same = sum(a == b for r, g in pairs for a, b in zip(r, g, strict=True))
    total = sum(len(r) for r, _ in pairs)
    first = sum(r[0] == g[0] for r, g in pairs)
    kls = [
        kl_divergence(p, q)
        for p, q in zip(reference["first_logprobs"], got["first_logprobs"], strict=True)
    ]
    return {
        "token_match_rate": same / total,
        "first_token_match": first / len(pairs),
        "first_token_kl": statistics.mean(kls),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    ratios = [float(r) for r in args.ratios.split(",")]
    if any(not 0 <= r <= 1 for r in ratios):
        raise ValueError(f"--ratios must be in [0, 1], got {args.ratios!r}")
    if args.docs_per_prompt > args.pool:
        raise ValueError("--docs-per-prompt must not exceed --pool")
    results: dict[str, Any] = {}
    llm = _llm(args, prefix_caching=False, blend=False)
    try:
        tokenizer = None if args.separator_ids else llm.get_tokenizer()
        work = make_workload(args, tokenizer)
        _warm(llm, work)
        results["full_prefill"] = _measure(llm, args, work, None, args.repeats)
    finally:
        llm.llm_engine.shutdown()
    llm = _llm(args, prefix_caching=True, blend=False)
    try:
        _warm(llm, work)
        # One run: a repeat would find its own prompt in the prefix cache.
        results["prefix_caching"] = _measure(llm, args, work, None, 1)
    finally:
        llm.llm_engine.shutdown()
    llm = _llm(args, prefix_caching=False, blend=True)
    try:
        _warm(llm, work)
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner
        stats = runner.blend_runner.stats
        for ratio in ratios:
            hits, misses = stats.segment_hits, stats.segment_misses
            measured = _measure(llm, args, work, ratio, args.repeats)
            measured.update(agreement(results["full_prefill"], measured))
            # Each prompt runs repeats + 2 times; count one run's lookups.
            measured["segment_hits"] = (stats.segment_hits - hits) // (args.repeats + 2)
            measured["segment_misses"] = (stats.segment_misses - misses) // (args.repeats + 2)
            results[f"blend_{ratio:g}"] = measured
    finally:
        llm.llm_engine.shutdown()
    results["workload"] = {
        "prompts": len(work.prompts),
        "docs_per_prompt": args.docs_per_prompt,
        "pool": args.pool,
        "prompt_tokens_mean": statistics.mean(len(p) for p in work.prompts),
        "reordered_prompts": work.reordered,
    }
    return results


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=EngineArgs.model)
    parser.add_argument("--pool", type=int, default=6, help="documents to draw from")
    parser.add_argument("--docs-per-prompt", type=int, default=3)
    parser.add_argument("--min-doc-tokens", type=int, default=300)
    parser.add_argument("--max-doc-tokens", type=int, default=800)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--ratios", default="0,0.05,0.15,0.3,1")
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="TTFT runs per prompt (min)")
    parser.add_argument("--separator", default=" # # ")
    parser.add_argument(
        "--separator-ids", default="", help="a model without a tokenizer: the separator's ids"
    )
    parser.add_argument("--vocab-size", type=int, default=0, help="with --separator-ids")
    parser.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)


def table(results: dict[str, Any]) -> str:
    w = results["workload"]
    lines = [
        f"{w['prompts']} prompts of {w['docs_per_prompt']} documents from a pool of "
        f"{w['pool']} (mean {w['prompt_tokens_mean']:.0f} tokens)",
        f"{'configuration':<16} {'TTFT ms':>8} {'match@N':>8} {'1st tok':>8} {'1st KL':>9} "
        f"{'seg hits':>8}",
    ]
    for name, r in results.items():
        if name == "workload":
            continue
        row = f"{name:<16} {r['ttft_s'] * 1000:8.1f}"
        if "token_match_rate" in r:
            row += (
                f" {r['token_match_rate']:8.1%} {r['first_token_match']:8.1%}"
                f" {r['first_token_kl']:9.2e} {r['segment_hits']:8d}"
            )
        lines.append(row)
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    results = run(args)
    print(table(results))
    if args.output_json:
        slim = {
            name: {k: v for k, v in r.items() if k not in ("tokens", "first_logprobs")}
            for name, r in results.items()
        }
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(slim, f, indent=2)
    return 0
