"""The memory read-rate probe (csrc/memory_probe.cpp) and `kvserve bench memory`."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from kvserve import _custom_ops
from kvserve.benchmarks import memory


def test_probe_returns_a_positive_finite_rate_per_thread_count() -> None:
    for huge_pages in (False, True):
        rates = _custom_ops.memory_read_rates(8 << 20, 2, 1, huge_pages)
        assert len(rates) == 2
        assert all(math.isfinite(r) and r > 0 for r in rates)


def test_probe_rejects_bad_arguments() -> None:
    with pytest.raises(RuntimeError, match="nbytes must be >= 1 MiB"):
        _custom_ops.memory_read_rates(4096, 1, 1)
    with pytest.raises(RuntimeError, match="max_threads must be >= 1"):
        _custom_ops.memory_read_rates(8 << 20, 0, 1)


def test_buffer_is_far_larger_than_the_last_level_cache() -> None:
    llc = memory.last_level_cache_bytes()
    assert memory.probe_bytes() >= max(256 << 20, 8 * (llc or 0))
    assert memory.read_bound([10.0, 18.0, 19.0]) == 18.0  # two threads' rate
    assert memory.read_bound([10.0]) == 10.0  # one core: its own


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    memory.add_cli_args(parser)
    return parser.parse_args(list(argv))


def test_bench_memory_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "memory.json"
    args = _args("--threads", "2", "--size-mib", "8", "--repeats", "1", "--output-json", str(out))
    assert memory.main(args) == 0
    printed = capsys.readouterr().out
    assert (
        "| threads | GB/s, huge pages | GB/s, 4 KiB pages |" in printed
        and "read bound (2 threads)" in printed
    )
    report = json.loads(out.read_text())
    assert report["buffer_bytes"] == 8 << 20
    assert set(report["gb_s_by_threads"]) == set(report["gb_s_by_threads_4k_pages"]) == {"1", "2"}
    assert report["read_bound_gb_s"] == report["gb_s_by_threads"]["2"] > 0


def test_bench_memory_names_a_bad_field() -> None:
    with pytest.raises(ValueError, match="threads"):
        memory.run_memory(_args("--threads", "0"))
