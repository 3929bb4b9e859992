"""RSS of a server process and its children while a soak runs: peak, last, and a time series.

The server itself is "api_server"; its direct children started by multiprocessing's
spawn are "engine_core" (numbered if there are several), and their spawned children, the
workers of a multiprocess executor (tensor or pipeline parallel), are "worker_N". Other
processes are left out: multiprocessing's resource tracker, and short-lived helpers (a
compiler check, a fork before exec) that would otherwise look like a lost process. A
process seen once and gone later is reported in `lost`: an engine core that died
mid-soak shows there.

`rss_trend` reads a series after its warm-up: the mean at the start and at the end, the
growth between them, and the least-squares slope, which tells steady growth (a leak)
from a level that is merely high.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

MIB = 1024 * 1024
MAX_WINDOW_S = 60.0


class RssSampler:
    """Peak and last RSS every `interval_s`; the series every `series_interval_s` once
    `run(t0)` has started, in seconds since t0."""

    def __init__(self, pid: int, interval_s: float = 0.25, series_interval_s: float = 1.0) -> None:
        import psutil  # a benchmark/test dependency, not the server's

        self._psutil = psutil
        self.root = psutil.Process(pid)
        self.interval_s = interval_s
        self.series_interval_s = series_interval_s
        self.roles: dict[int, str] = {}  # pid -> role
        self.peak: dict[str, int] = {}  # role -> bytes
        self.last: dict[str, int] = {}
        self.series: dict[str, list[tuple[float, int]]] = {}  # role -> (s since t0, bytes)
        self.lost: list[str] = []
        self._t0: float | None = None
        self._next_series = 0.0
        self.sample()

    def _spawned_children(self, proc: Any) -> list[Any]:
        try:
            children = proc.children()
        except self._psutil.Error:
            return []
        kept = []
        for child in children:
            try:
                cmdline = " ".join(child.cmdline())
            except self._psutil.Error:
                continue
            if "spawn_main" in cmdline and "resource_tracker" not in cmdline:
                kept.append(child)
        return kept

    def _processes(self) -> list[tuple[Any, str]]:
        """(process, role) of the server, its engine cores and their workers."""
        found = [(self.root, self._role(self.root.pid, "api_server"))]
        for core in self._spawned_children(self.root):
            found.append((core, self._role(core.pid, "engine_core")))
            found += [(w, self._role(w.pid, "worker")) for w in self._spawned_children(core)]
        return found

    def _role(self, pid: int, kind: str) -> str:
        if pid not in self.roles:
            taken = sum(r == kind or r.startswith(kind + "_") for r in self.roles.values())
            # Workers are always numbered; the first engine core is not (the usual, single one).
            numbered = kind == "worker" or taken > 0
            self.roles[pid] = f"{kind}_{taken}" if numbered else kind
        return self.roles[pid]

    def sample(self) -> None:
        now = time.monotonic()
        record = self._t0 is not None and now >= self._next_series
        if record:
            self._next_series = now + self.series_interval_s
        seen = set()
        for proc, role in self._processes():
            try:
                rss = int(proc.memory_info().rss)
            except self._psutil.Error:
                continue
            seen.add(proc.pid)
            self.last[role] = rss
            self.peak[role] = max(self.peak.get(role, 0), rss)
            if record and self._t0 is not None:
                self.series.setdefault(role, []).append((now - self._t0, rss))
        for pid, role in self.roles.items():
            if pid not in seen and role not in self.lost:
                self.lost.append(role)

    async def run(self, t0: float) -> None:
        """Samples until cancelled; the series' times count from t0 (time.monotonic())."""
        self._t0 = t0
        interval = min(self.interval_s, self.series_interval_s)
        while True:
            self.sample()
            await asyncio.sleep(interval)

    def peak_mib(self) -> dict[str, float]:
        return {role: round(v / MIB, 2) for role, v in self.peak.items()}

    def last_mib(self) -> dict[str, float]:
        return {role: round(v / MIB, 2) for role, v in self.last.items()}

    def series_mib(self) -> dict[str, list[tuple[float, float]]]:
        return {
            role: [(round(t, 2), round(v / MIB, 2)) for t, v in points]
            for role, points in self.series.items()
        }


def trend_window_s(elapsed_s: float, warmup_s: float) -> float:
    """The span averaged at each end: 60 s, or a third of the time after the warm-up when
    that is shorter (so a short run's two ends do not overlap)."""
    return min(MAX_WINDOW_S, max(elapsed_s - warmup_s, 0.0) / 3)


def rss_trend(
    series: Sequence[tuple[float, float]], warmup_s: float, window_s: float
) -> dict[str, float | int | None]:
    """Start and end level (MiB, mean over `window_s`), growth between them (%) and the
    slope (MiB per minute, least squares) of (seconds, MiB) samples after `warmup_s`."""
    points = np.array([p for p in series if p[0] >= warmup_s], dtype=np.float64).reshape(-1, 2)
    trend: dict[str, float | int | None] = {
        "samples": len(points),
        "rss_start_mib": None,
        "rss_end_mib": None,
        "growth_pct": None,
        "slope_mib_per_min": None,
    }
    if len(points) < 2:
        return trend
    t, mib = points[:, 0], points[:, 1]
    start = float(mib[t <= t[0] + window_s].mean())
    end = float(mib[t >= t[-1] - window_s].mean())
    trend["rss_start_mib"] = round(start, 2)
    trend["rss_end_mib"] = round(end, 2)
    # (+ 0.0: a flat series' -1e-15 would read "-0.0".)
    trend["growth_pct"] = round((end - start) / start * 100, 3) + 0.0 if start else None
    if t[-1] > t[0]:
        trend["slope_mib_per_min"] = round(float(np.polyfit(t / 60, mib, 1)[0]), 4) + 0.0
    return trend
