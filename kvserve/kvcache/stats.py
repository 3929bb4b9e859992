"""Counters of the KV tier, and a Prometheus collector over them.

CacheStats is plain thread-safe counters (the disk writer and prefetch threads update it
too). The engine exports them by registering a collector it owns:

    prometheus_client.REGISTRY.register(CacheStatsCollector(cache_engine.stats))
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

# Seconds, from a CPU-tier hit to a slow remote store.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    bytes_stored: int = 0
    bytes_retrieved: int = 0
    evictions: int = 0
    errors: int = 0  # corrupt values, failed or timed-out remote calls, dropped writes
    auth_failures: int = 0  # values whose MAC failed (planted or foreign): misses as well


@dataclass
class LatencyStats:
    count: int = 0
    total: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        self.buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1


class CacheStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.tiers: dict[str, TierStats] = {}
        self.store_latency = LatencyStats()
        self.retrieve_latency = LatencyStats()
        self.lookup_requests = 0
        self.lookup_hit_tokens = 0
        self.lookup_query_tokens = 0

    def tier(self, name: str) -> TierStats:
        with self._lock:
            return self.tiers.setdefault(name, TierStats())

    def add(self, tier: str, **counts: int) -> None:
        with self._lock:
            stats = self.tiers.setdefault(tier, TierStats())
            for name, value in counts.items():
                setattr(stats, name, getattr(stats, name) + value)

    def observe_store(self, seconds: float) -> None:
        with self._lock:
            self.store_latency.observe(seconds)

    def observe_retrieve(self, seconds: float) -> None:
        with self._lock:
            self.retrieve_latency.observe(seconds)

    def observe_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        with self._lock:
            self.lookup_requests += 1
            self.lookup_query_tokens += query_tokens
            self.lookup_hit_tokens += hit_tokens

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "tiers": {name: vars(s).copy() for name, s in self.tiers.items()},
                "store_latency": (self.store_latency.count, self.store_latency.total),
                "retrieve_latency": (self.retrieve_latency.count, self.retrieve_latency.total),
                "lookup_requests": self.lookup_requests,
                "lookup_query_tokens": self.lookup_query_tokens,
                "lookup_hit_tokens": self.lookup_hit_tokens,
            }


class CacheStatsCollector:
    """A prometheus_client custom collector; the caller registers it in its registry."""

    PREFIX = "kvserve:kvcache_"

    def __init__(self, stats: CacheStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        p = self.PREFIX
        snap_tiers = self.stats.snapshot()["tiers"]
        for field_name, doc in (
            ("hits", "Chunks found in the tier"),
            ("misses", "Chunks asked of the tier and not found"),
            ("bytes_stored", "Bytes written to the tier"),
            ("bytes_retrieved", "Bytes read from the tier"),
            ("evictions", "Chunks evicted from the tier"),
            ("errors", "Corrupt values, failed remote calls and dropped writes"),
            ("auth_failures", "Values that failed authentication (not loaded; misses too)"),
        ):
            family = CounterMetricFamily(p + field_name, doc, labels=["tier"])
            for tier, values in sorted(snap_tiers.items()):
                family.add_metric([tier], values[field_name])
            yield family
        lookups = CounterMetricFamily(p + "lookup_hit_tokens", "Prefix tokens found by lookups")
        lookups.add_metric([], self.stats.lookup_hit_tokens)
        yield lookups
        queries = CounterMetricFamily(p + "lookup_query_tokens", "Tokens asked by lookups")
        queries.add_metric([], self.stats.lookup_query_tokens)
        yield queries
        for name, lat in (
            ("store_seconds", self.stats.store_latency),
            ("retrieve_seconds", self.stats.retrieve_latency),
        ):
            cumulative, buckets = 0, []
            for bound, count in zip((*LATENCY_BUCKETS, float("inf")), lat.buckets, strict=True):
                cumulative += count
                buckets.append((str(bound) if bound != float("inf") else "+Inf", cumulative))
            yield HistogramMetricFamily(
                p + name,
                f"KV tier {name.split('_')[0]} latency",
                buckets=buckets,
                sum_value=lat.total,
            )
