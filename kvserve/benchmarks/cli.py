"""`kvserve bench serve|throughput|kvcache|blend|memdiff|peers|quantization|soak|startup|cascade|moe|kv-transfer|pipeline|spec-decode`: wires the benchmarks into the kvserve command."""

from __future__ import annotations

import argparse

from kvserve.benchmarks import (
    blend,
    cascade,
    kv_transfer,
    kvcache,
    memdiff,
    moe,
    peers,
    pipeline,
    quant_accuracy,
    serve,
    soak,
    spec_decode,
    startup,
    throughput,
)


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    bench = subparsers.add_parser("bench", help="benchmark a server or offline throughput")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    serve_parser = sub.add_parser(
        "serve", help="load-test an OpenAI-compatible server (TTFT, TPOT, ITL, throughput)"
    )
    serve.add_cli_args(serve_parser)
    serve_parser.set_defaults(func=serve.main)
    transfer = sub.add_parser(
        "kv-transfer", help="P2pZmqConnector's transport: GB/s of whole KV transfers"
    )
    kv_transfer.add_cli_args(transfer)
    transfer.set_defaults(func=kv_transfer.main)
    offline = sub.add_parser("throughput", help="offline generation throughput (LLM class)")
    throughput.add_cli_args(offline)
    offline.set_defaults(func=throughput.main)
    heap = sub.add_parser(
        "memdiff", help="what grew per process between heap snapshots (KVSERVE_TRACEMALLOC_DIR)"
    )
    memdiff.add_cli_args(heap)
    heap.set_defaults(func=memdiff.main)
    tiers = sub.add_parser(
        "kvcache", help="TTFT per KV tier; bytes, cost and error per serde; agreement"
    )
    kvcache.add_cli_args(tiers)
    tiers.set_defaults(func=kvcache.main)
    blending = sub.add_parser(
        "blend", help="CacheBlend vs full prefill vs prefix caching: TTFT and agreement"
    )
    blend.add_cli_args(blending)
    blending.set_defaults(func=blend.main)
    peer_parser = sub.add_parser("peers", help="kvserve vs HF transformers vs llama.cpp, same GGUF")
    peers.add_cli_args(peer_parser)
    peer_parser.set_defaults(func=peers.main)
    quant = sub.add_parser("quantization", help="greedy agreement of --quantization methods")
    quant_accuracy.add_cli_args(quant)
    quant.set_defaults(func=quant_accuracy.main)
    soak_parser = sub.add_parser("soak", help="misbehaving clients vs one loopback server")
    soak.add_cli_args(soak_parser)
    soak_parser.set_defaults(func=soak.main)
    boot = sub.add_parser("startup", help="cold and warm start-up time, phase by phase")
    startup.add_cli_args(boot)
    boot.set_defaults(func=startup.main)
    shared = sub.add_parser("cascade", help="decode throughput, cascade attention on vs off")
    cascade.add_cli_args(shared)
    shared.set_defaults(func=cascade.main)
    experts = sub.add_parser("moe", help="FusedMoE vs a per-expert loop vs HF's MoE block")
    moe.add_cli_args(experts)
    experts.set_defaults(func=moe.main)
    stages = sub.add_parser("pipeline", help="PP throughput with the batch queue vs without")
    pipeline.add_cli_args(stages)
    stages.set_defaults(func=pipeline.main)
    spec = sub.add_parser(
        "spec-decode", help="speculative methods on agentic code edits and on plain chat"
    )
    spec_decode.add_cli_args(spec)
    spec.set_defaults(func=spec_decode.main)
    return bench
