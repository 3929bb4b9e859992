"""`kvserve bench moe` runs end to end on a small layer and its three implementations
agree (speed itself is reported by the benchmark, never asserted)."""

from __future__ import annotations

import argparse
import json

import pytest

from kvserve.benchmarks import moe


def test_bench_moe_runs_and_implementations_agree(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    moe.add_cli_args(parser)
    args = parser.parse_args(
        "--hidden-size 64 --intermediate-size 96 --num-tokens 1 33 --rounds 2 --json".split()
    )
    assert moe.main(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["num_tokens"] for r in rows] == [1, 33]
    for row in rows:
        assert set(row["ms"]) == set(moe.IMPLEMENTATIONS)
        assert all(ms > 0 for ms in row["ms"].values())
        assert row["max_abs_diff"] < 1e-4
