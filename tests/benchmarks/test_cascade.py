"""`kvserve bench cascade`: a small shared-prefix batch through both engines."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvserve.benchmarks.cli import add_bench_parser

pytestmark = pytest.mark.slow


def test_bench_cascade_prints_and_saves(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    out = tmp_path / "cascade.json"
    args = parser.parse_args(
        ["bench", "cascade", "--num-requests", "4", "--prefix-len", "40", "--output-len", "3",
         "--repeats", "1", "--kv-cache-memory", "32M", "--max-model-len", "256",
         "--output-json", str(out)]
    )  # fmt: skip
    assert args.func(args) == 0  # 0: the two engines' tokens were identical
    printed = capsys.readouterr().out
    assert "Cascade speedup:" in printed and "row by row" in printed
    result = json.loads(out.read_text())
    assert result["tokens_identical"] and not result["cost_rule_chooses_cascade"]
    for key in ("cascade_on", "cascade_off"):
        assert result[key]["decode_steps"] == 2  # output_len - 1 pure decode steps
        assert result[key]["decode_tokens_per_s"] > 0
