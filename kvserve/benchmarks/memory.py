"""`kvserve bench memory`: the machine's memory read rate at 1..N threads.

Single-stream decode of a 1B-plus model reads every weight once per token, so its speed is
bounded by how fast the cores can read memory, not by their FLOP rate. The probe
(csrc/memory_probe.cpp) streams a buffer several times the last-level cache with 1..N
threads, on transparent huge pages and on plain 4 KiB pages (what an allocation gets where
the kernel's THP mode is "madvise", the common default; streaming then stalls on page
walks). `kvserve bench peers` reports the same figures and sets each single stream's
weight bytes per second against the two-thread huge-page rate (the read bound).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

# The probe's buffer: this many times the last-level cache, and never under the floor, so
# nearly every read comes from memory whatever the cache's replacement policy.
_LLC_MULTIPLE = 8
_MIN_BUFFER = 256 << 20
_SYS_CACHE = Path("/sys/devices/system/cpu/cpu0/cache")
# The thread count whose rate bounds a decode that uses the machine's cores (issue 44: two
# threads that together read at the machine's rate); fewer cores: their count.
BOUND_THREADS = 2


def last_level_cache_bytes() -> int | None:
    """Size of cpu0's largest cache level from sysfs, or None where sysfs does not say."""
    best: tuple[int, int] | None = None
    for index in sorted(_SYS_CACHE.glob("index*")):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        size = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        if best is None or level > best[0]:
            best = (level, size)
    return None if best is None else best[1]


def probe_bytes() -> int:
    llc = last_level_cache_bytes() or 0
    return max(_MIN_BUFFER, _LLC_MULTIPLE * llc)


def read_rates(
    max_threads: int | None = None,
    nbytes: int | None = None,
    repeats: int = 3,
    huge_pages: bool = True,
) -> list[float]:
    """GB/s of 1..max_threads threads (default: every core) reading together."""
    from kvserve import _custom_ops

    threads = max_threads or os.cpu_count() or 1
    return _custom_ops.memory_read_rates(nbytes or probe_bytes(), threads, repeats, huge_pages)


def read_bound(rates: list[float]) -> float:
    """The read bound among ``rates`` (index i = i + 1 threads): BOUND_THREADS' rate."""
    return rates[min(BOUND_THREADS, len(rates)) - 1]


def machine_read_rates() -> dict[str, list[float]]:
    """The probe's rates on huge and on 4 KiB pages for `bench peers`' machine line;
    empty without the C++ kernels."""
    from kvserve import _custom_ops

    if not _custom_ops.available():
        return {}
    return {"huge_pages": read_rates(), "4k_pages": read_rates(huge_pages=False)}


def format_rates(rates: dict[str, list[float]]) -> str:
    if not rates:
        return "memory read rate unmeasured (no C++ kernels)"
    huge, small = (", ".join(f"{r:.1f}" for r in rates[k]) for k in ("huge_pages", "4k_pages"))
    threads = len(rates["huge_pages"])
    return f"memory read {huge} GB/s at 1..{threads} threads ({small} on 4 KiB pages)"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads", type=int, default=None, help="largest thread count (default: every core)"
    )
    parser.add_argument(
        "--size-mib", type=int, default=None,
        help=f"buffer size (default: {_LLC_MULTIPLE}x the last-level cache, at least "
        f"{_MIN_BUFFER >> 20} MiB)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5, help="best of this many passes")
    parser.add_argument("--output-json", default=None, help="write the results as JSON here")


def run_memory(args: argparse.Namespace) -> dict[str, Any]:
    for name in ("threads", "size_mib", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"{name}: must be at least 1, got {value}")
    nbytes = (args.size_mib << 20) if args.size_mib else probe_bytes()
    rates = read_rates(args.threads, nbytes, args.repeats)
    small = read_rates(args.threads, nbytes, args.repeats, huge_pages=False)
    return {
        "buffer_bytes": nbytes,
        "last_level_cache_bytes": last_level_cache_bytes(),
        "load_avg": os.getloadavg(),
        "gb_s_by_threads": {str(i + 1): r for i, r in enumerate(rates)},
        "gb_s_by_threads_4k_pages": {str(i + 1): r for i, r in enumerate(small)},
        "read_bound_gb_s": read_bound(rates),
        "read_bound_threads": min(BOUND_THREADS, len(rates)),
    }


def format_report(report: dict[str, Any]) -> str:
    llc = report["last_level_cache_bytes"]
    lines = [
        f"buffer {report['buffer_bytes'] >> 20} MiB (last-level cache "
        f"{'unknown' if llc is None else f'{llc >> 20} MiB'}), load avg "
        f"{report['load_avg'][0]:.2f}",
        "",
        "| threads | GB/s, huge pages | GB/s, 4 KiB pages |",
        "|---|---|---|",
        *(
            f"| {t} | {r:.1f} | {report['gb_s_by_threads_4k_pages'][t]:.1f} |"
            for t, r in report["gb_s_by_threads"].items()
        ),
        "",
        f"read bound ({report['read_bound_threads']} threads): "
        f"{report['read_bound_gb_s']:.1f} GB/s",
    ]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    report = run_memory(args)
    print(format_report(report))
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
        print(f"results written to {args.output_json}")
    return 0
