"""`kvserve bench soak --plot`: RSS per process against time, from one or two soak reports.

One panel per process (their levels differ by gigabytes, so each gets its own scale),
minutes since the soak's start on x, the warm-up shaded, the slope and growth after it in
the legend. A second report (`--compare-json`, say the run before a fix) is drawn dashed
in the same panels. The reports are the JSON that `--output-json` writes, which holds
the series.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

ROLE_ORDER = ("api_server", "engine_core", "worker")


def load_report(path: str) -> dict[str, Any]:
    with open(path) as f:
        report = json.load(f)
    if not report.get("rss_series"):
        raise SystemExit(f"{path} has no rss_series (a soak's --output-json of a run with RSS)")
    return dict(report)


def _role_key(role: str) -> tuple[int, str]:
    kind = next((i for i, k in enumerate(ROLE_ORDER) if role.startswith(k)), len(ROLE_ORDER))
    return kind, role


def plot_rss(runs: Sequence[tuple[str, dict[str, Any]]], path: str) -> None:
    """Writes a PNG of the RSS series of `runs` ((label, report) pairs, the first solid)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise SystemExit(
            "--plot needs matplotlib: pip install 'kvserve[bench]' (or pip install matplotlib)"
        ) from None
    roles = sorted({r for _, report in runs for r in report["rss_series"]}, key=_role_key)
    # Figure without pyplot: no global backend state, no GUI toolkit, Agg for savefig.
    fig = Figure(figsize=(8.0, 2.2 + 2.4 * len(roles)))
    axes = fig.subplots(len(roles), 1, sharex=True, squeeze=False)[:, 0]
    warmup_min = runs[0][1].get("rss_warmup_s", 0.0) / 60
    for ax, role in zip(axes, roles, strict=True):
        ax.axvspan(0, warmup_min, color="0.9", label="warm-up")
        for i, (label, report) in enumerate(runs):
            points = report["rss_series"].get(role)
            if not points:
                continue
            trend = report.get("rss", {}).get(role, {})
            slope, growth = trend.get("slope_mib_per_min"), trend.get("growth_pct")
            stats = (
                f"{slope:+.3f} MiB/min, {growth:+.2f}%"
                if slope is not None and growth is not None
                else "no trend"
            )
            ax.plot(
                [t / 60 for t, _ in points],
                [mib for _, mib in points],
                linestyle="-" if i == 0 else "--",
                color=f"C{i}",
                linewidth=1.2,
                label=f"{label}: {stats}",
            )
        ax.set_title(role, fontsize=10, loc="left")
        ax.set_ylabel("RSS (MiB)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    axes[-1].set_xlabel("minutes since the soak started")
    first = runs[0][1]
    fig.suptitle(
        f"RSS per process: {first.get('clients')} clients, mix {first.get('mix')}, "
        f"{first.get('duration_s')} s (slope and growth after the warm-up)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
