"""StatsHistory: a stat logger that keeps the recent past, second by second, for a live view.

It records the same (SchedulerStats, IterationStats) pairs the Prometheus logger turns into
``/metrics``, so the two always agree; what it adds is time: a rolling window of one-second
samples, in which gauges keep their peak (a KV cache that filled and emptied within a second
still shows) and counters their increase.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from kvserve.metrics.loggers import StatLoggerBase
from kvserve.metrics.stats import IterationStats
from kvserve.protocol.engine_core import SchedulerStats

# Connector metrics named tier_<field> are per-tier running totals ({"tier_hits": {"cpu": 3}}).
_TIER_PREFIX = "tier_"


@dataclass(kw_only=True)
class Counts:
    """What both a second and the whole run count (a sample's increase, or the totals)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    requests_finished: int = 0

    def add(self, other: Counts) -> None:
        for f in fields(Counts):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass(kw_only=True)
class Sample(Counts):
    """One second: gauges at their peak, counters as their increase within the second."""

    t: int
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    # Engine-core seconds spent stepping: busy / 1 s is how loaded the engine was.
    engine_busy_s: float = 0.0


@dataclass(kw_only=True)
class Totals(Counts):
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    time_to_first_token_sum_s: float = 0.0
    time_to_first_token_count: int = 0
    e2e_latency_sum_s: float = 0.0


@dataclass(kw_only=True)
class EngineView:
    """One data-parallel core as the dashboard shows it."""

    engine: int
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Its running totals as last reported.
    busy_s: float = 0.0
    last_preemptions: int = 0


class StatsHistory(StatLoggerBase):
    """Current gauges, totals since start and the last ``window_s`` seconds of samples.

    Not thread-safe: record() and snapshot() run on the same event loop (AsyncLLM's output
    handler and the HTTP handlers).
    """

    def __init__(
        self, model_name: str, window_s: int = 300, clock: Callable[[], float] = time.time
    ) -> None:
        if window_s < 1:
            raise ValueError(f"window_s must be at least 1, got {window_s}")
        self.model_name = model_name
        self.window_s = window_s
        self.clock = clock
        self.start_time = clock()
        self.current = SchedulerStats()
        self.totals = Totals()
        self.connector_stats: dict[str, dict[str, float]] = {}
        # Closed seconds, oldest first, each with the gauges in force when it closed;
        # seconds without any record (an idle engine reports nothing) are absent.
        self._samples: deque[tuple[Sample, SchedulerStats]] = deque(maxlen=window_s)
        self._open: Sample | None = None
        # Per data-parallel core: its gauges and totals (running totals it reports too,
        # whose increase the samples take).
        self.engines: dict[int, EngineView] = {}

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_idx: int = 0,
    ) -> None:
        sample = self._sample_at(int(self.clock()))
        counts = Counts()
        if scheduler_stats is not None:
            s = scheduler_stats
            view = self.engines.setdefault(engine_idx, EngineView(engine=engine_idx))
            view.num_running_reqs = s.num_running_reqs
            view.num_waiting_reqs = s.num_waiting_reqs
            view.kv_cache_usage = s.kv_cache_usage
            view.prefix_cache_queries += s.prefix_cache_queries
            view.prefix_cache_hits += s.prefix_cache_hits
            views = self.engines.values()
            # The fleet's gauges: the cores' latest, added up (usage: their mean).
            self.current = SchedulerStats(
                num_running_reqs=sum(v.num_running_reqs for v in views),
                num_waiting_reqs=sum(v.num_waiting_reqs for v in views),
                kv_cache_usage=sum(v.kv_cache_usage for v in views) / len(views),
            )
            cur = self.current
            sample.num_running_reqs = max(sample.num_running_reqs, cur.num_running_reqs)
            sample.num_waiting_reqs = max(sample.num_waiting_reqs, cur.num_waiting_reqs)
            sample.kv_cache_usage = max(sample.kv_cache_usage, cur.kv_cache_usage)
            counts.prefix_cache_queries = s.prefix_cache_queries
            counts.prefix_cache_hits = s.prefix_cache_hits
            counts.num_preemptions = max(s.num_preemptions - view.last_preemptions, 0)
            view.last_preemptions = s.num_preemptions
            if s.step_times is not None:
                busy = max(s.step_times.busy - view.busy_s, 0.0)
                sample.engine_busy_s += busy
                view.busy_s = s.step_times.busy
            if s.kv_connector_stats:
                self.connector_stats = s.kv_connector_stats
        if iteration_stats is not None:
            it = iteration_stats
            counts.prompt_tokens = it.num_prompt_tokens
            counts.generation_tokens = it.num_generation_tokens
            counts.requests_finished = len(it.finished_requests)
            totals = self.totals
            totals.time_to_first_token_sum_s += sum(it.time_to_first_tokens_iter)
            totals.time_to_first_token_count += len(it.time_to_first_tokens_iter)
            for finished in it.finished_requests:
                reason = finished.finish_reason
                totals.finished_by_reason[reason] = totals.finished_by_reason.get(reason, 0) + 1
                totals.e2e_latency_sum_s += finished.e2e_latency
        sample.add(counts)
        self.totals.add(counts)

    def _sample_at(self, second: int) -> Sample:
        self._close_before(second)
        if self._open is None:
            self._open = Sample(t=second)
        return self._open

    def _close_before(self, second: int) -> None:
        # self.current is still the last report within the open second: what stays in force.
        if self._open is not None and self._open.t < second:
            self._samples.append((self._open, self.current))
            self._open = None

    def history(self, since: float = 0.0) -> list[Sample]:
        """Every closed second after ``since`` within the window, oldest first, idle seconds
        included: those repeat the gauges the engine last reported, with counters at 0."""
        now = int(self.clock())
        self._close_before(now)
        first = max(int(self.start_time), now - self.window_s, int(since) + 1)
        recorded = {sample.t: (sample, after) for sample, after in self._samples}
        earlier = [after for sample, after in self._samples if sample.t < first]
        gauges = earlier[-1] if earlier else SchedulerStats()
        out: list[Sample] = []
        for second in range(first, now):
            if second in recorded:
                sample, gauges = recorded[second]
            else:
                sample = Sample(
                    t=second,
                    num_running_reqs=gauges.num_running_reqs,
                    num_waiting_reqs=gauges.num_waiting_reqs,
                    kv_cache_usage=gauges.kv_cache_usage,
                )
            out.append(sample)
        return out

    def tiers(self) -> dict[str, dict[str, float]]:
        """{tier: {field: running total}} from the KV connector's tier_<field> metrics."""
        out: dict[str, dict[str, float]] = {}
        for metric, values in self.connector_stats.items():
            if metric.startswith(_TIER_PREFIX):
                for tier, value in values.items():
                    out.setdefault(tier, {})[metric.removeprefix(_TIER_PREFIX)] = value
        return out

    def snapshot(self, since: float = 0.0) -> dict[str, Any]:
        """The JSON document the dashboard polls (see docs/web_ui.md for its fields)."""
        return {
            "model": self.model_name,
            "time": self.clock(),
            "start_time": self.start_time,
            "interval_s": 1,
            "window_s": self.window_s,
            "current": {
                "num_running_reqs": self.current.num_running_reqs,
                "num_waiting_reqs": self.current.num_waiting_reqs,
                "kv_cache_usage": self.current.kv_cache_usage,
            },
            "totals": asdict(self.totals),
            "tiers": self.tiers(),
            "connector": {
                k: v for k, v in self.connector_stats.items() if not k.startswith(_TIER_PREFIX)
            },
            "history": [asdict(s) for s in self.history(since)],
            "engines": [
                {k: v for k, v in asdict(view).items() if k != "last_preemptions"}
                for _, view in sorted(self.engines.items())
            ],
        }
