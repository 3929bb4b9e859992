"""Serving benchmark statistics computed from per-request measurements."""

from __future__ import annotations

import pytest

from kvserve.benchmarks.metrics import calculate_metrics
from kvserve.benchmarks.serve import RequestFuncOutput


def test_throughput_and_latency_summaries() -> None:
    outputs = [
        RequestFuncOutput(
            success=True,
            generated_text="abc",
            prompt_len=10,
            output_tokens=3,
            ttft=0.1,
            itl=[0.05, 0.05],
            latency=0.2,
        ),
        RequestFuncOutput(
            success=True,
            generated_text="abcde",
            prompt_len=20,
            output_tokens=5,
            ttft=0.3,
            itl=[0.1] * 4,
            latency=0.7,
        ),
        RequestFuncOutput(success=False, error="HTTP 500"),
    ]
    m = calculate_metrics(outputs, duration_s=2.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 8)
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 4.0
    assert m["total_token_throughput"] == 19.0
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_e2el_ms"] == pytest.approx(450.0)
    # TPOT excludes the first token: (0.2-0.1)/2 and (0.7-0.3)/4.
    assert m["mean_tpot_ms"] == pytest.approx(75.0)
    assert m["mean_itl_ms"] == pytest.approx(1000 * (0.1 + 0.4) / 6)
    assert m["p99_e2el_ms"] == pytest.approx(695.0)
    assert m["errors"] == ["HTTP 500"]
