"""Stat loggers: a periodic one-line log and Prometheus metrics with vLLM's names."""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvserve.metrics.multimodal import MultiModalProm
from kvserve.metrics.spec_decode import SpecDecodingLogging, SpecDecodingProm
from kvserve.metrics.stats import IterationStats
from kvserve.protocol.engine_core import STEP_PHASES, SchedulerStats, StepTimes

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "kvserve"
# Seconds; the same spread vLLM uses, from a fast decode step to a long request.
_LATENCY_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
]


class StatLoggerBase(ABC):
    @abstractmethod
    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_idx: int = 0,
    ) -> None:
        """One message's stats; ``engine_idx``: the data-parallel rank of the core that
        sent it (its running totals are that core's own)."""

    def log(self) -> None:  # noqa: B027 - optional hook
        """Called periodically (every few seconds) by the engine."""


def _fleet_gauges(per_engine: dict[int, SchedulerStats]) -> SchedulerStats:
    stats = list(per_engine.values())
    if len(stats) == 1:
        return stats[0]
    return SchedulerStats(
        num_running_reqs=sum(s.num_running_reqs for s in stats),
        num_waiting_reqs=sum(s.num_waiting_reqs for s in stats),
        kv_cache_usage=sum(s.kv_cache_usage for s in stats) / len(stats),
        kv_cache_blocks_in_use=sum(s.kv_cache_blocks_in_use for s in stats),
    )


class LoggingStatLogger(StatLoggerBase):
    """Accumulates between log() calls and prints one line: throughput, queue, KV cache."""

    def __init__(self, engine_index: int = 0) -> None:
        self.engine_index = engine_index
        self.last_scheduler_stats = SchedulerStats()
        self._per_engine: dict[int, SchedulerStats] = {}
        self.spec_decoding_logging = SpecDecodingLogging()
        self._reset(time.monotonic())
        self._last_line_idle = False

    def _reset(self, now: float) -> None:
        self.last_log_time = now
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.prefix_queries = 0
        self.prefix_hits = 0

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_idx: int = 0,
    ) -> None:
        if iteration_stats is not None:
            self.num_prompt_tokens += iteration_stats.num_prompt_tokens
            self.num_generation_tokens += iteration_stats.num_generation_tokens
        if scheduler_stats is not None:
            # Gauges: one line for the fleet, the cores' latest counts added up.
            self._per_engine[engine_idx] = scheduler_stats
            self.last_scheduler_stats = _fleet_gauges(self._per_engine)
            self.prefix_queries += scheduler_stats.prefix_cache_queries
            self.prefix_hits += scheduler_stats.prefix_cache_hits
            if scheduler_stats.spec_decoding_stats is not None:
                self.spec_decoding_logging.observe(scheduler_stats.spec_decoding_stats)

    def format_line(self, now: float) -> str:
        elapsed = max(now - self.last_log_time, 1e-9)
        stats = self.last_scheduler_stats
        hit_rate = self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
        return (
            f"Engine {self.engine_index:03d}: "
            f"Avg prompt throughput: {self.num_prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self.num_generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {stats.num_running_reqs} reqs, Waiting: {stats.num_waiting_reqs} reqs, "
            f"KV cache usage: {stats.kv_cache_usage * 100:.1f}%, "
            f"Prefix cache hit rate: {hit_rate * 100:.1f}%"
        )

    def log(self) -> None:
        now = time.monotonic()
        stats = self.last_scheduler_stats
        idle = (
            not self.num_prompt_tokens
            and not self.num_generation_tokens
            and not stats.num_running_reqs
            and not stats.num_waiting_reqs
        )
        # One idle line after activity, then silence until work arrives again.
        if not (idle and self._last_line_idle):
            logger.info("%s", self.format_line(now))
        spec_line = self.spec_decoding_logging.format_line(now - self.last_log_time)
        if spec_line is not None:
            logger.info("%s", spec_line)
        self._last_line_idle = idle
        self._reset(now)


@dataclass
class _EngineSeries:
    """One core's labelled children of the step counters, and the running totals it
    last reported (the core reports totals; the counters take deltas)."""

    engine: str
    phase_counters: dict[str, Any]
    busy_counter: Any
    steps_counter: Any
    num_preemptions: int = 0
    step_times: StepTimes = field(default_factory=StepTimes)
    connector_stats: dict[tuple[str, str], float] = field(default_factory=dict)


class PrometheusStatLogger(StatLoggerBase):
    """vLLM's metric names under ``<prefix>:`` (``kvserve:`` by default, ``vllm:`` for
    tools that read vLLM's series), labelled with model_name and engine (the
    data-parallel rank of the core whose outputs carried the stats, "0" without DP).

    Constructing a second logger on the same registry unregisters the first one's
    metrics, so tests and restarted engines in one process do not collide.
    """

    _live: ClassVar[dict[int, PrometheusStatLogger]] = {}

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        self.registry = registry if registry is not None else prometheus_client.REGISTRY
        previous = self._live.get(id(self.registry))
        if previous is not None:
            previous.unregister()
        self._live[id(self.registry)] = self
        self.model_name = model_name
        labels = ["model_name", "engine"]
        reg = self.registry
        self.prefix = prefix = prefix + ":"

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(prefix + name, doc, labels, registry=reg)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(prefix + name, doc, labels + list(extra), registry=reg)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(prefix + name, doc, labels, buckets=_LATENCY_BUCKETS, registry=reg)

        self.num_requests_running = gauge("num_requests_running", "Requests in model execution")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to run")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV cache usage, 1 = full")
        # vLLM's older name of the same gauge, still what some routers and dashboards read.
        self.gpu_cache_usage_perc = (
            gauge("gpu_cache_usage_perc", "KV cache usage, 1 = full (vLLM's older name)")
            if prefix == "vllm:"
            else None
        )
        self.kv_cache_blocks_in_use = gauge(
            "kv_cache_blocks_in_use", "KV cache blocks held by requests (0 when idle)"
        )
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found there")
        self.num_preemptions = counter("num_preemptions", "Preemptions by the scheduler")
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed")
        self.generation_tokens = counter("generation_tokens", "Generation tokens produced")
        self.request_success = counter(
            "request_success", "Finished requests by finish reason", ("finished_reason",)
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first output token"
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between consecutive output tokens"
        )
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds", "Per request: mean time per output token"
        )
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Arrival to finish")
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled"
        )
        self.step_time = counter(
            "step_time_seconds",
            "Seconds per step phase: the engine core's and the front end's output_processing",
            ("phase",),
        )
        self.engine_busy = counter("engine_busy_seconds", "Engine-core seconds spent in steps")
        self.engine_steps = counter("engine_steps", "Engine-core steps")
        # Per core: its labelled children and the running totals it last reported.
        self._engines: dict[int, _EngineSeries] = {}
        self._engine(0)  # every phase shows (at 0) before the first request
        self._collectors = [
            self.num_requests_running,
            self.num_requests_waiting,
            self.kv_cache_usage_perc,
            self.kv_cache_blocks_in_use,
            self.prefix_cache_queries,
            self.prefix_cache_hits,
            self.num_preemptions,
            self.prompt_tokens,
            self.generation_tokens,
            self.request_success,
            self.time_to_first_token,
            self.inter_token_latency,
            self.time_per_output_token,
            self.e2e_request_latency,
            self.request_queue_time,
            self.step_time,
            self.engine_busy,
            self.engine_steps,
        ]
        self.spec_decoding = SpecDecodingProm(reg, prefix, model_name)
        self._collectors += self.spec_decoding.collectors
        self.multimodal = MultiModalProm(reg, prefix, model_name)
        self._collectors += self.multimodal.collectors
        if self.gpu_cache_usage_perc is not None:
            self._collectors.append(self.gpu_cache_usage_perc)
        # KV connector totals (tier hits, bytes, ...): counters made as metrics first appear.
        self._connector_counters: dict[str, Counter] = {}

    def _engine(self, engine_idx: int) -> _EngineSeries:
        series = self._engines.get(engine_idx)
        if series is None:
            engine = str(engine_idx)
            name = self.model_name
            # Children made once: recording skips the label lookups on every message.
            series = _EngineSeries(
                engine=engine,
                phase_counters={
                    phase: self.step_time.labels(name, engine, phase)
                    for phase in (*STEP_PHASES, "output_processing")
                },
                busy_counter=self.engine_busy.labels(name, engine),
                steps_counter=self.engine_steps.labels(name, engine),
            )
            self._engines[engine_idx] = series
        return series

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_idx: int = 0,
    ) -> None:
        name = self.model_name
        series = self._engine(engine_idx)
        engine = series.engine
        if scheduler_stats is not None:
            s = scheduler_stats
            self.num_requests_running.labels(name, engine).set(s.num_running_reqs)
            self.num_requests_waiting.labels(name, engine).set(s.num_waiting_reqs)
            self.kv_cache_usage_perc.labels(name, engine).set(s.kv_cache_usage)
            if self.gpu_cache_usage_perc is not None:
                self.gpu_cache_usage_perc.labels(name, engine).set(s.kv_cache_usage)
            self.kv_cache_blocks_in_use.labels(name, engine).set(s.kv_cache_blocks_in_use)
            self.prefix_cache_queries.labels(name, engine).inc(s.prefix_cache_queries)
            self.prefix_cache_hits.labels(name, engine).inc(s.prefix_cache_hits)
            # The scheduler reports preemptions as a running total; the counter takes deltas.
            new_preemptions = s.num_preemptions - series.num_preemptions
            self.num_preemptions.labels(name, engine).inc(max(new_preemptions, 0))
            series.num_preemptions = s.num_preemptions
            if s.kv_connector_stats:
                self._record_connector_stats(s.kv_connector_stats, series)
            if s.step_times is not None:
                self._record_step_times(s.step_times, series)
            if s.spec_decoding_stats is not None:
                self.spec_decoding.record(s.spec_decoding_stats, engine)
            if s.mm_stats is not None:
                self.multimodal.record(s.mm_stats, engine)
        if iteration_stats is None:
            return
        if iteration_stats.output_processing_time:
            series.phase_counters["output_processing"].inc(iteration_stats.output_processing_time)
        self.prompt_tokens.labels(name, engine).inc(iteration_stats.num_prompt_tokens)
        self.generation_tokens.labels(name, engine).inc(iteration_stats.num_generation_tokens)
        ttft = self.time_to_first_token.labels(name, engine)
        for value in iteration_stats.time_to_first_tokens_iter:
            ttft.observe(value)
        itl = self.inter_token_latency.labels(name, engine)
        for value in iteration_stats.inter_token_latencies_iter:
            itl.observe(value)
        for finished in iteration_stats.finished_requests:
            self.request_success.labels(name, engine, finished.finish_reason).inc()
            self.e2e_request_latency.labels(name, engine).observe(finished.e2e_latency)
            self.request_queue_time.labels(name, engine).observe(finished.queued_time)
            if finished.num_generation_tokens > 1:
                self.time_per_output_token.labels(name, engine).observe(
                    finished.mean_time_per_output_token
                )

    def _record_step_times(self, totals: StepTimes, series: _EngineSeries) -> None:
        last = series.step_times
        for phase in STEP_PHASES:
            delta = getattr(totals, phase) - getattr(last, phase)
            series.phase_counters[phase].inc(max(delta, 0.0))
        series.busy_counter.inc(max(totals.busy - last.busy, 0.0))
        series.steps_counter.inc(max(totals.num_steps - last.num_steps, 0))
        series.step_times = totals

    def _record_connector_stats(
        self, stats: dict[str, dict[str, float]], series: _EngineSeries
    ) -> None:
        for metric, values in stats.items():
            counter = self._connector_counters.get(metric)
            if counter is None:
                counter = Counter(
                    self.prefix + "kv_connector_" + metric,
                    f"KV connector running total: {metric}",
                    ["model_name", "engine", "kind"],
                    registry=self.registry,
                )
                self._connector_counters[metric] = counter
                self._collectors.append(counter)
            for kind, value in values.items():
                delta = value - series.connector_stats.get((metric, kind), 0.0)
                series.connector_stats[(metric, kind)] = value
                counter.labels(self.model_name, series.engine, kind).inc(max(delta, 0.0))

    def unregister(self) -> None:
        for collector in self._collectors:
            try:
                self.registry.unregister(collector)
            except KeyError:
                pass  # already gone
        self._collectors = []
        if self._live.get(id(self.registry)) is self:
            del self._live[id(self.registry)]
