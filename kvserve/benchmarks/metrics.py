"""Serving benchmark statistics: throughput and TTFT / TPOT / ITL / E2E latency summaries."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from kvserve.benchmarks.serve import RequestFuncOutput

LATENCIES = (
    ("ttft", "Time to First Token"),
    ("tpot", "Time per Output Token (excl. 1st)"),
    ("itl", "Inter-token Latency"),
    ("e2el", "End-to-end Latency"),
)


def _summary(name: str, values_s: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0 if len(values_s) else np.zeros(1)
    return {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"p99_{name}_ms": float(np.percentile(ms, 99)),
        f"std_{name}_ms": float(ms.std()),
    }


def calculate_metrics(outputs: Sequence[RequestFuncOutput], duration_s: float) -> dict[str, Any]:
    """Aggregates per-request measurements; failed requests count only in `failed`."""
    done = [o for o in outputs if o.success]
    # The server's usage is exact; without it, each text chunk counts as one token.
    output_lens = [o.output_tokens or (len(o.itl) + 1 if o.generated_text else 0) for o in done]
    input_lens = [o.prompt_len for o in done]
    tpots = [
        (o.latency - o.ttft) / (n - 1) for o, n in zip(done, output_lens, strict=True) if n > 1
    ]
    duration_s = max(duration_s, 1e-9)
    metrics: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "total_input_tokens": sum(input_lens),
        "total_output_tokens": sum(output_lens),
        "request_throughput": len(done) / duration_s,
        "input_throughput": sum(input_lens) / duration_s,
        "output_throughput": sum(output_lens) / duration_s,
        "total_token_throughput": (sum(input_lens) + sum(output_lens)) / duration_s,
    }
    metrics.update(_summary("ttft", [o.ttft for o in done]))
    metrics.update(_summary("tpot", tpots))
    metrics.update(_summary("itl", [x for o in done for x in o.itl]))
    metrics.update(_summary("e2el", [o.latency for o in done]))
    metrics.update(
        {
            "input_lens": input_lens,
            "output_lens": output_lens,
            "ttfts": [o.ttft for o in done],
            "e2els": [o.latency for o in done],
            "errors": sorted({o.error for o in outputs if o.error})[:10],
        }
    )
    return metrics


def print_metrics(m: dict[str, Any]) -> None:
    def row(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{label:<40}{text:>12}")

    print("{s:{c}^52}".format(s=" Serving Benchmark Result ", c="="))
    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"])
    row("Input token throughput (tok/s):", m["input_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    for key, title in LATENCIES:
        print("{s:{c}^52}".format(s=f" {title} ", c="-"))
        row(f"Mean {key.upper()} (ms):", m[f"mean_{key}_ms"])
        row(f"Median {key.upper()} (ms):", m[f"median_{key}_ms"])
        row(f"P99 {key.upper()} (ms):", m[f"p99_{key}_ms"])
    if m["errors"]:
        print("errors:", *m["errors"][:3], sep="\n  ")
    print("=" * 52)
