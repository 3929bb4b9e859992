"""`kvserve bench kvcache`: TTFT of a long document, recomputed vs loaded from each KV tier.

For every tier the document is asked once (filling the tier), the engine's prefix cache is
reset, and the document is asked again `--repeats` times (prefix cache reset before each):
that second TTFT is the tier's. The baseline recomputes with no connector. With
`--agreement-tokens N`, it also measures how often greedy tokens continued from int8 KV
agree with the recomputed ones (the cost of the 4x smaller int8 serde).

Offline TTFT here is the wall time of a one-token generate() call.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from typing import Any

from kvserve.args.engine_args import EngineArgs
from kvserve.sampling_params import SamplingParams
from kvserve.utils.processes import free_port

_WORDS = (
    "river market engine quiet summer copper lantern harbor signal garden winter paper "
    "mountain careful orbit silver village thunder patient window marble forest rapid "
    "ancient kettle meadow velvet circuit amber canyon whisper ledger compass timber"
).split()


def make_document_ids(tokenizer: Any, num_tokens: int, seed: int = 0) -> list[int]:
    """num_tokens token ids of a deterministic synthetic document."""
    rng = random.Random(seed)
    sentences = []
    while True:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 14))]
        sentences.append(" ".join(words).capitalize() + ".")
        ids = tokenizer.encode(" ".join(sentences), add_special_tokens=False)
        if len(ids) >= num_tokens:
            return list(ids[:num_tokens])


def start_redis() -> tuple[subprocess.Popen[bytes], str] | None:
    """A throwaway redis-server (no persistence) on a free port, if one is installed."""
    binary = shutil.which("redis-server")
    if binary is None:
        return None
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.terminate()
    return None


def _llm(args: argparse.Namespace, extra: dict[str, Any] | None) -> Any:
    from kvserve.entrypoints.llm import LLM

    kwargs: dict[str, Any] = {"kv_cache_memory": args.kv_cache_memory}
    if extra is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "TieredCacheConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"chunk_size": args.chunk_size, **extra},
        }
    return LLM(args.model, **kwargs)


def _ttft(llm: Any, ids: list[int]) -> tuple[float, int]:
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1), use_tqdm=False)
    return time.perf_counter() - t0, out[0].num_cached_tokens or 0


def measure_tier(args: argparse.Namespace, ids: list[int], extra: dict[str, Any] | None) -> dict:
    llm = _llm(args, extra)
    try:
        cold, _ = _ttft(llm, ids)  # fills the tier (and warms the engine)
        runs = [_ttft(llm, ids) for _ in range(args.repeats)]
    finally:
        llm.llm_engine.shutdown()
    return {
        "cold_ttft_s": cold,
        "ttft_s": statistics.median(t for t, _ in runs),
        "cached_tokens": runs[-1][1],
    }


def measure_int8_agreement(args: argparse.Namespace, docs: list[list[int]]) -> dict[str, Any]:
    """Greedy continuations from int8 KV vs recomputed, token by token."""
    llm = _llm(args, {"local_cpu_serde": "int8"})
    params = SamplingParams(max_tokens=args.agreement_tokens, temperature=0.0, ignore_eos=True)
    same = total = prefix_same = 0
    try:
        for ids in docs:
            llm.reset_prefix_cache()
            ref = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
            llm.reset_prefix_cache()
            got = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
            a, b = ref.outputs[0].token_ids, got.outputs[0].token_ids
            same += sum(x == y for x, y in zip(a, b, strict=False))
            total += len(a)
            prefix_same += next(
                (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a)
            )
    finally:
        llm.llm_engine.shutdown()
    return {
        "prompts": len(docs),
        "tokens_per_prompt": args.agreement_tokens,
        "position_agreement": same / max(total, 1),
        "mean_identical_prefix": prefix_same / max(len(docs), 1),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"num_tokens": args.num_tokens, "chunk_size": args.chunk_size}
    base = _llm(args, None)
    ids = make_document_ids(base.get_tokenizer(), args.num_tokens, args.seed)
    docs = [
        make_document_ids(base.get_tokenizer(), args.num_tokens, args.seed + i)
        for i in range(args.agreement_prompts)
    ]
    try:
        _ttft(base, ids)
        results["recompute"] = {
            "ttft_s": statistics.median(_ttft(base, ids)[0] for _ in range(args.repeats))
        }
    finally:
        base.llm_engine.shutdown()
    disk_dir = tempfile.mkdtemp(prefix="kvserve-bench-disk-")
    tiers: dict[str, dict[str, Any]] = {
        "cpu": {},
        "disk": {"local_cpu": False, "local_disk": disk_dir},
    }
    redis = None
    if args.redis_url == "auto":
        redis = start_redis()
        if redis is not None:
            tiers["redis"] = {"local_cpu": False, "remote_url": redis[1]}
    elif args.redis_url:
        tiers["redis"] = {"local_cpu": False, "remote_url": args.redis_url}
    try:
        for name, extra in tiers.items():
            results[name] = measure_tier(args, ids, extra)
            results[name]["speedup"] = results["recompute"]["ttft_s"] / results[name]["ttft_s"]
        if args.agreement_tokens > 0:
            results["int8_agreement"] = measure_int8_agreement(args, docs)
    finally:
        if redis is not None:
            redis[0].terminate()
        shutil.rmtree(disk_dir, ignore_errors=True)
    return results


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=EngineArgs.model)
    parser.add_argument("--num-tokens", type=int, default=2000)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    parser.add_argument(
        "--redis-url", default="auto", help="redis://host:port/db, 'auto' (start one) or ''"
    )
    parser.add_argument("--agreement-tokens", type=int, default=32)
    parser.add_argument("--agreement-prompts", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)


def main(args: argparse.Namespace) -> int:
    results = run(args)
    print(f"TTFT for a {args.num_tokens}-token document (median of {args.repeats}):")
    print(f"  recompute     {results['recompute']['ttft_s'] * 1000:8.1f} ms")
    for name in ("cpu", "disk", "redis"):
        if name in results:
            r = results[name]
            print(
                f"  {name:<13} {r['ttft_s'] * 1000:8.1f} ms  ({r['speedup']:.1f}x, "
                f"{r['cached_tokens']} tokens from the tier)"
            )
    if "int8_agreement" in results:
        a = results["int8_agreement"]
        print(
            f"int8 KV: {a['position_agreement']:.1%} of greedy tokens agree with recompute "
            f"({a['mean_identical_prefix']:.1f} of {a['tokens_per_prompt']} identical before "
            f"the first difference, {a['prompts']} prompts)"
        )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    add_cli_args(p)
    raise SystemExit(main(p.parse_args()))
