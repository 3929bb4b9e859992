"""`kvserve bench memdiff DIR`: what grew in each process between two heap snapshots.

DIR holds the snapshots a server wrote with KVSERVE_TRACEMALLOC_DIR set (see
utils/memory_trace.py). Per process, the first snapshot at or after --warmup seconds is
compared with the last; the report gives the traced total at both, its growth per
minute, and the allocation sites (grouped by their stack, or by line) that grew most,
with the number of blocks they added. A site that grows steadily with traffic is a
leak or an unbounded cache; one that grew once and stays is a warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tracemalloc
from collections import defaultdict
from typing import Any

SNAPSHOT_NAME = re.compile(r"^(?P<role>.+)-(?P<pid>\d+)-(?P<seconds>\d+)\.snap$")
# Allocations of the tracer itself and of the import system are not the program's.
IGNORED = (
    tracemalloc.Filter(False, tracemalloc.__file__),
    tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
    tracemalloc.Filter(False, "<frozen importlib._bootstrap_external>"),
    tracemalloc.Filter(False, "<unknown>"),
)
MIB = 1024 * 1024


def find_snapshots(directory: str) -> dict[str, list[tuple[int, str]]]:
    """ "role (pid)" -> [(seconds, path)], oldest first."""
    found: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for name in os.listdir(directory):
        match = SNAPSHOT_NAME.match(name)
        if match:
            process = f"{match['role']} ({match['pid']})"
            found[process].append((int(match["seconds"]), os.path.join(directory, name)))
    return {process: sorted(snaps) for process, snaps in sorted(found.items())}


def _where(trace: tracemalloc.Traceback, frames: int) -> list[str]:
    """The innermost frames, newest first, as file:line (paths shortened to the package)."""
    out = []
    for frame in list(reversed(trace))[:frames]:
        path = frame.filename
        for marker in ("site-packages/", "kvserve/", "lib/python3"):
            if marker in path:
                path = path[path.index(marker) + (len(marker) if marker != "kvserve/" else 0) :]
                break
        out.append(f"{path}:{frame.lineno}")
    return out


def diff_process(
    snapshots: list[tuple[int, str]], warmup_s: float, top: int, key_type: str, frames: int
) -> dict[str, Any] | None:
    after = [s for s in snapshots if s[0] >= warmup_s] or snapshots[-1:]
    (t0, first_path), (t1, last_path) = after[0], snapshots[-1]
    if t1 <= t0:
        return None
    first = tracemalloc.Snapshot.load(first_path).filter_traces(IGNORED)
    last = tracemalloc.Snapshot.load(last_path).filter_traces(IGNORED)
    stats = last.compare_to(first, key_type)
    total0 = sum(s.size for s in first.statistics("filename"))
    total1 = sum(s.size for s in last.statistics("filename"))
    minutes = (t1 - t0) / 60.0
    grew = [s for s in stats if s.size_diff > 0][:top]
    return {
        "from_s": t0,
        "to_s": t1,
        "traced_start_mib": round(total0 / MIB, 2),
        "traced_end_mib": round(total1 / MIB, 2),
        "growth_mib_per_min": round((total1 - total0) / MIB / minutes, 3),
        "top_growth": [
            {
                "size_diff_kib": round(s.size_diff / 1024, 1),
                "count_diff": s.count_diff,
                "size_kib": round(s.size / 1024, 1),
                "where": _where(s.traceback, frames),
            }
            for s in grew
        ],
    }


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="KVSERVE_TRACEMALLOC_DIR of the profiled server")
    parser.add_argument("--warmup", type=float, default=300.0, help="seconds (default 300)")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument(
        "--key-type", choices=["traceback", "lineno", "filename"], default="traceback"
    )
    parser.add_argument("--frames", type=int, default=4, help="frames shown per site")
    parser.add_argument("--output-json", default=None)


def main(args: argparse.Namespace) -> int:
    report = {}
    for process, snapshots in find_snapshots(args.directory).items():
        result = diff_process(snapshots, args.warmup, args.top, args.key_type, args.frames)
        if result is not None:
            report[process] = result
    if not report:
        print(f"no two snapshots of one process in {args.directory}")
        return 1
    for process, result in report.items():
        print(
            f"\n{process}: {result['traced_start_mib']} -> {result['traced_end_mib']} MiB "
            f"traced from {result['from_s']} s to {result['to_s']} s "
            f"({result['growth_mib_per_min']:+} MiB/min)"
        )
        for site in result["top_growth"]:
            print(f"  {site['size_diff_kib']:+10.1f} KiB {site['count_diff']:+8d} blocks")
            for line in site["where"]:
                print(f"        {line}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
