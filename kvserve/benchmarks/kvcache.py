"""`kvserve bench kvcache`: TTFT of a long document, recomputed vs loaded from each KV tier,
and what each serde costs.

For every tier the document is asked once (filling the tier), the engine's prefix cache is
reset, and the document is asked again `--repeats` times (prefix cache reset before each):
that second TTFT is the tier's. The baseline recomputes with no connector. The Redis tier
is measured once per serde in `--remote-serdes` (the CPU and disk tiers use raw).

Serdes: on the model's real KV for the document's full chunks (read back from the CPU
tier), each serde in `--serdes` is timed encoding and decoding every chunk (median of
`--repeats` passes, one thread per process as the tier's threads run them), with the
bytes it stores per token, its ratio to raw, and its error (relative L2 of K and V, and
the largest absolute error). With `--agreement-tokens N`, it also measures how often
greedy tokens continued from each lossy serde's KV (`--agreement-serdes`) agree with the
recomputed ones.

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
from collections.abc import Sequence
from typing import Any

import torch

from kvserve.args.engine_args import EngineArgs
from kvserve.kvcache import serde
from kvserve.kvcache.config import parse_remote_url
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


def measure_agreement(
    args: argparse.Namespace, docs: list[list[int]], serde_name: str
) -> dict[str, Any]:
    """Greedy continuations from KV stored with serde_name (in the CPU tier) vs recomputed,
    token by token."""
    llm = _llm(args, {"local_cpu_serde": serde_name})
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


def real_kv_chunks(args: argparse.Namespace, ids: list[int]) -> list[torch.Tensor]:
    """The model's KV for the full chunks of ids, as the CPU tier stores it (raw)."""
    from kvserve.kvcache.builder import CacheEngineBuilder

    llm = _llm(args, {})
    try:
        llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1), use_tqdm=False)
        engine_id = llm.llm_engine.config.kv_transfer_config.engine_id
        result = CacheEngineBuilder.get(engine_id).retrieve(ids)
        return [kv.clone() for _, _, kv in result.chunks]
    finally:
        llm.llm_engine.shutdown()


def _median_seconds(fn: Any, repeats: int) -> tuple[float, float]:
    """Median wall and CPU seconds of fn() (CPU time is the cost; on a shared machine the
    wall time also counts the time other processes held the cores)."""
    wall, cpu = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(wall), statistics.median(cpu)


def measure_serde(chunks: Sequence[torch.Tensor], name: str, repeats: int) -> dict[str, float]:
    """One serde over chunks shaped [layers, 2, tokens, heads, head_size]: stored bytes per
    token and ratio to raw, encode and decode wall and CPU time per chunk (and decode CPU
    time per token), and the decoded KV's error (relative L2 of K and of V, largest absolute error)."""
    tokens = sum(kv.shape[2] for kv in chunks)
    raw_bytes = sum(kv.numel() * kv.element_size() for kv in chunks)
    encoded = [serde.encode(kv, name) for kv in chunks]
    stored = sum(len(payload) for _, payload in encoded)
    encode_s, encode_cpu = _median_seconds(
        lambda: [serde.encode(kv, name) for kv in chunks], repeats
    )
    decode_s, decode_cpu = _median_seconds(lambda: [serde.decode(*e) for e in encoded], repeats)
    sq_err, sq_norm, max_abs = [0.0, 0.0], [0.0, 0.0], 0.0
    for kv, e in zip(chunks, encoded, strict=True):
        ref, out = kv.float(), serde.decode(*e).float()
        for slot in (0, 1):  # K, V
            sq_err[slot] += float((out[:, slot] - ref[:, slot]).pow(2).sum())
            sq_norm[slot] += float(ref[:, slot].pow(2).sum())
        max_abs = max(max_abs, float((out - ref).abs().max()))
    return {
        "bytes_per_token": stored / tokens,
        "ratio_to_raw": raw_bytes / stored,
        "encode_ms_per_chunk": encode_s * 1000 / len(chunks),
        "decode_ms_per_chunk": decode_s * 1000 / len(chunks),
        "encode_cpu_ms_per_chunk": encode_cpu * 1000 / len(chunks),
        "decode_cpu_ms_per_chunk": decode_cpu * 1000 / len(chunks),
        "decode_cpu_us_per_token": decode_cpu * 1e6 / tokens,
        "rel_error_k": (sq_err[0] / max(sq_norm[0], 1e-30)) ** 0.5,
        "rel_error_v": (sq_err[1] / max(sq_norm[1], 1e-30)) ** 0.5,
        "max_abs_error": max_abs,
    }


def measure_serdes(
    chunks: Sequence[torch.Tensor], serdes: Sequence[str], repeats: int
) -> dict[str, dict[str, float]]:
    """measure_serde for each serde, on one thread: the tiers encode and decode on their
    own threads, and one thread is steadier on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {name: measure_serde(chunks, name, repeats) for name in serdes}
    finally:
        torch.set_num_threads(threads)


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
    redis_url = args.redis_url
    if redis_url == "auto":
        redis = start_redis()
        redis_url = None if redis is None else redis[1]
    if redis_url:
        _, host, port, db = parse_remote_url(redis_url)
        for i, name in enumerate(_names(args.remote_serdes)):
            # A db of its own per serde, so that each tier is filled with its own chunks.
            tiers["redis" if name == "raw" else f"redis-{name}"] = {
                "local_cpu": False,
                "remote_url": f"redis://{host}:{port}/{db + i}",
                "remote_serde": name,
            }
    try:
        for name, extra in tiers.items():
            results[name] = measure_tier(args, ids, extra)
            results[name]["speedup"] = results["recompute"]["ttft_s"] / results[name]["ttft_s"]
        serdes = _names(args.serdes)
        if serdes:
            chunks = real_kv_chunks(args, ids)
            results["serdes"] = measure_serdes(chunks, serdes, args.repeats)
        if args.agreement_tokens > 0:
            results["agreement"] = {
                name: measure_agreement(args, docs, name) for name in _names(args.agreement_serdes)
            }
    finally:
        if redis is not None:
            redis[0].terminate()
        shutil.rmtree(disk_dir, ignore_errors=True)
    return results


def _names(csv: str) -> list[str]:
    names = [n.strip() for n in csv.split(",") if n.strip()]
    for name in names:
        if name not in serde.SERDES:
            raise ValueError(f"unknown serde {name!r}; choose from {', '.join(serde.SERDES)}")
    return names


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=EngineArgs.model)
    parser.add_argument("--num-tokens", type=int, default=2000)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    parser.add_argument(
        "--redis-url", default="auto", help="redis://host:port/db, 'auto' (start one) or ''"
    )
    all_serdes = ",".join(serde.SERDES)
    parser.add_argument(
        "--serdes", default=all_serdes, help=f"serdes to size and time on real KV ({all_serdes})"
    )
    parser.add_argument(
        "--remote-serdes",
        default="raw,int8-zstd,int4-zstd",
        help="one Redis tier per serde, for TTFT ('' for none)",
    )
    parser.add_argument(
        "--agreement-serdes",
        default="int8,int8-zstd,int4-zstd",
        help="lossy serdes whose greedy agreement with recompute is measured",
    )
    parser.add_argument("--agreement-tokens", type=int, default=32)
    parser.add_argument("--agreement-prompts", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)


def main(args: argparse.Namespace) -> int:
    results = run(args)
    print(f"TTFT for a {args.num_tokens}-token document (median of {args.repeats}):")
    print(f"  recompute     {results['recompute']['ttft_s'] * 1000:8.1f} ms")
    for name, r in results.items():
        if isinstance(r, dict) and "speedup" in r:
            print(
                f"  {name:<17} {r['ttft_s'] * 1000:8.1f} ms  ({r['speedup']:.1f}x, "
                f"{r['cached_tokens']} tokens from the tier)"
            )
    if "serdes" in results:
        print("serdes on the document's real KV (per chunk unless noted, one thread):")
        print(
            f"  {'serde':<10} {'bytes/token':>11} {'vs raw':>7} {'encode ms':>10} "
            f"{'decode ms':>10} {'(CPU ms)':>9} {'decode CPU us/tok':>17} {'rel err K':>9} "
            f"{'rel err V':>9} {'max err':>8}"
        )
        for name, c in results["serdes"].items():
            print(
                f"  {name:<10} {c['bytes_per_token']:11.0f} {c['ratio_to_raw']:6.2f}x "
                f"{c['encode_ms_per_chunk']:10.2f} {c['decode_ms_per_chunk']:10.2f} "
                f"{c['decode_cpu_ms_per_chunk']:9.2f} {c['decode_cpu_us_per_token']:17.2f} "
                f"{c['rel_error_k']:9.4f} {c['rel_error_v']:9.4f} {c['max_abs_error']:8.4f}"
            )
    for name, a in results.get("agreement", {}).items():
        print(
            f"{name} KV: {a['position_agreement']:.1%} of greedy tokens agree with recompute "
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
