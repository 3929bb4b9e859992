"""`kvserve bench <command>`: wires the benchmarks into the kvserve command. Each benchmark
module has ``add_cli_args(parser)`` and ``main(args) -> int``."""

from __future__ import annotations

import argparse
from types import ModuleType

from kvserve.benchmarks import (
    blend,
    cascade,
    chat_user,
    kv_transfer,
    kvcache,
    long_context,
    memdiff,
    memory,
    moe,
    peers,
    pipeline,
    quant_accuracy,
    serve,
    soak,
    spec_decode,
    startup,
    throughput,
    ubatch,
)

BENCHMARKS: tuple[tuple[str, ModuleType, str], ...] = (
    ("serve", serve, "load-test an OpenAI-compatible server (TTFT, TPOT, ITL, throughput)"),
    ("chat-user", chat_user, "one user chatting: kvserve serve vs a peer server, TTFT split"),
    ("kv-transfer", kv_transfer, "P2pZmqConnector's transport: GB/s of whole KV transfers"),
    ("throughput", throughput, "offline generation throughput (LLM class)"),
    ("memdiff", memdiff, "what grew per process between heap snapshots (KVSERVE_TRACEMALLOC_DIR)"),
    ("memory", memory, "memory read rate (GB/s) at 1..N threads: the bound of 1B+ decode"),
    ("kvcache", kvcache, "TTFT per KV tier; bytes, cost and error per serde; agreement"),
    ("blend", blend, "CacheBlend vs full prefill vs prefix caching: TTFT and agreement"),
    ("peers", peers, "kvserve vs HF transformers vs llama.cpp, same GGUF"),
    ("quantization", quant_accuracy, "greedy agreement of --quantization methods"),
    ("soak", soak, "misbehaving clients vs one loopback server"),
    ("startup", startup, "cold and warm start-up time, phase by phase"),
    ("cascade", cascade, "decode throughput, cascade attention on vs off"),
    ("long-context", long_context, "decode tok/s at 8k-32k tokens of context vs llama.cpp"),
    ("moe", moe, "FusedMoE vs a per-expert loop vs HF's MoE block"),
    ("pipeline", pipeline, "PP throughput with the batch queue vs without"),
    ("ubatch", ubatch, "TP step time with dual batch overlap (--enable-dbo) vs without"),
    ("spec-decode", spec_decode, "speculative methods on agentic code edits and on plain chat"),
)


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    bench = subparsers.add_parser("bench", help="benchmark a server or offline throughput")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, module, help_text in BENCHMARKS:
        parser = sub.add_parser(name, help=help_text)
        module.add_cli_args(parser)
        parser.set_defaults(func=module.main)
    return bench
