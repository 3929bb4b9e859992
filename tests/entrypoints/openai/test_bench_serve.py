"""`kvserve bench serve` against the live server: it prints and saves its metrics."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvserve.benchmarks.cli import add_bench_parser
from kvserve.benchmarks.step_times import PHASES
from tests.entrypoints.openai.utils import RemoteServer

pytestmark = pytest.mark.slow


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", *argv])
    return int(args.func(args))


@pytest.mark.parametrize(
    ("dataset", "extra", "num_requests"),
    [
        ("random", ["--request-rate", "20", "--max-concurrency", "4"], 8),
        (
            "shared-prefix",
            ["--prefix-len", "16", "--num-prefixes", "2", "--backend", "openai-chat"],
            4,
        ),
        ("multi-turn", ["--num-turns", "2"], 4),
        # Every request under a grammar (at least 8 items: longer than the 3 tokens asked).
        (
            "random",
            ["--json-schema", '{"type": "array", "items": {"type": "integer"}, "minItems": 8}'],
            4,
        ),
    ],
)
def test_bench_serve_prints_and_saves_metrics(
    server: RemoteServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    dataset: str,
    extra: list[str],
    num_requests: int,
) -> None:
    result_file = tmp_path / "result.json"
    num_prompts = 2 if dataset == "multi-turn" else num_requests
    code = _run(
        [
            "serve",
            "--base-url",
            server.base_url,
            "--dataset-name",
            dataset,
            "--num-prompts",
            str(num_prompts),
            "--random-input-len",
            "12",
            "--random-output-len",
            "3",
            "--result-file",
            str(result_file),
            "--disable-tqdm",
            *extra,
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Mean TTFT (ms)" in printed
    assert "overhead (scheduler + input preparation + output processing): " in printed
    assert "% of wall time" in printed
    result = json.loads(result_file.read_text())
    assert result["completed"] == num_requests and result["failed"] == 0
    # ignore_eos is on by default: every request generates exactly the asked length.
    assert result["total_output_tokens"] == 3 * num_requests
    assert result["total_input_tokens"] > 0
    assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"]
    assert result["p99_e2el_ms"] >= result["median_e2el_ms"] > 0
    assert result["mean_tpot_ms"] > 0 and result["request_throughput"] > 0
    assert result["model"] == "SmolLM2-135M-Instruct"
    # The server's step time over the run, from its /metrics before and after.
    steps = result["step_time_breakdown"]
    assert set(steps["step_time_s"]) == set(PHASES) and steps["engine_steps"] > 0
    assert steps["step_time_s"]["forward"] > 0 and steps["engine_busy_s"] > 0
    assert steps["wall_s"] == result["duration"]
    overhead = sum(steps["step_time_s"][p] for p in PHASES if p != "forward")
    assert steps["overhead_s"] == pytest.approx(overhead)
    assert steps["overhead_wall_share"] == pytest.approx(overhead / result["duration"])
    assert steps["overhead_busy_share"] == pytest.approx(overhead / steps["engine_busy_s"])
