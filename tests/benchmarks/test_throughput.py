"""`kvserve bench throughput`: offline throughput on a few tiny random requests."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvserve.benchmarks.cli import add_bench_parser

pytestmark = pytest.mark.slow


def test_bench_throughput_prints_and_saves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    out = tmp_path / "throughput.json"
    args = parser.parse_args(
        [
            "bench",
            "throughput",
            "--num-prompts",
            "4",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--kv-cache-memory",
            "32M",
            "--max-model-len",
            "256",
            "--output-json",
            str(out),
            "--disable-tqdm",
        ]
    )
    assert args.func(args) == 0
    assert "requests/s" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["num_requests"] == 4
    assert result["total_output_tokens"] == 16  # ignore_eos: exactly output_len each
    assert result["requests_per_second"] > 0 and result["output_tokens_per_second"] > 0
