"""KVSERVE_TRACEMALLOC_DIR: a process writes heap snapshots on a schedule, and
`kvserve bench memdiff` finds the allocation site that kept growing between them."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from kvserve.benchmarks import memdiff

GROWER = textwrap.dedent(
    """
    import time
    from kvserve.utils import memory_trace

    assert memory_trace.start_from_env("grower")
    kept = []
    deadline = time.monotonic() + 2.6
    while time.monotonic() < deadline:
        kept.append(bytearray(64 * 1024))  # the leak: 64 KiB every 20 ms
        time.sleep(0.02)
    """
)


def test_snapshots_over_time_show_the_growing_site(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "KVSERVE_TRACEMALLOC_DIR": str(tmp_path),
        "KVSERVE_TRACEMALLOC_INTERVAL": "1",
        "KVSERVE_TRACEMALLOC_FRAMES": "2",
    }
    subprocess.run([sys.executable, "-c", GROWER], env=env, check=True, timeout=60)
    snapshots = memdiff.find_snapshots(str(tmp_path))
    assert len(snapshots) == 1
    [(process, snaps)] = snapshots.items()
    assert process.startswith("grower (") and len(snaps) >= 2
    assert not list(tmp_path.glob("*.tmp")), "a snapshot is renamed once written"

    out = tmp_path / "report.json"
    parser = argparse.ArgumentParser()
    memdiff.add_cli_args(parser)
    args = parser.parse_args([str(tmp_path), "--warmup", "0", "--output-json", str(out)])
    assert memdiff.main(args) == 0
    report = json.loads(out.read_text())[process]
    top = report["top_growth"][0]
    assert top["where"][0].startswith("<string>:"), top  # the bytearray line of GROWER
    assert top["size_diff_kib"] >= 64 and top["count_diff"] >= 1
    assert report["growth_mib_per_min"] > 0


def test_without_the_variable_nothing_is_traced() -> None:
    code = (
        "import tracemalloc; from kvserve.utils import memory_trace; "
        "assert not memory_trace.start_from_env('x'); assert not tracemalloc.is_tracing()"
    )
    env = {k: v for k, v in os.environ.items() if k != "KVSERVE_TRACEMALLOC_DIR"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
