"""Stat loggers fed with real EngineCoreOutput messages through the RequestStatsTracker."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvserve.metrics.loggers import LoggingStatLogger, PrometheusStatLogger
from kvserve.metrics.stats import IterationStats, RequestStatsTracker
from kvserve.protocol.engine_core import EngineCoreOutput, FinishReason, SchedulerStats, StepTimes


def _sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})


def _run_two_requests(tracker: RequestStatsTracker) -> list[IterationStats]:
    """Request a (5 prompt tokens) runs three steps to length; b (3 tokens) is aborted."""
    tracker.add_request("a", arrival_time=100.0, num_prompt_tokens=5)
    tracker.add_request("b", arrival_time=100.5, num_prompt_tokens=3)
    step1 = tracker.make_iteration_stats(
        [
            EngineCoreOutput(request_id="a", new_token_ids=[7]),
            EngineCoreOutput(request_id="b", new_token_ids=[8]),
        ],
        scheduled_times={"a": 100.25, "b": 100.75},
        now=101.0,
    )
    step2 = tracker.make_iteration_stats(
        [EngineCoreOutput(request_id="a", new_token_ids=[9])], now=101.5
    )
    step3 = tracker.make_iteration_stats(
        [EngineCoreOutput(request_id="a", new_token_ids=[10], finish_reason=FinishReason.LENGTH)],
        now=102.5,
    )
    aborted = IterationStats(iteration_timestamp=103.0)
    tracker.finish_requests(["b"], "abort", aborted)
    return [step1, step2, step3, aborted]


def test_tracker_computes_latencies_and_forgets_finished() -> None:
    tracker = RequestStatsTracker()
    step1, step2, step3, aborted = _run_two_requests(tracker)
    assert step1.num_prompt_tokens == 8 and step1.num_generation_tokens == 2
    assert step1.time_to_first_tokens_iter == [1.0, 0.5]
    assert step2.inter_token_latencies_iter == [0.5] and step2.num_prompt_tokens == 0
    (a,) = step3.finished_requests
    assert (a.finish_reason, a.e2e_latency, a.queued_time) == ("length", 2.5, 0.25)
    assert (a.num_prompt_tokens, a.num_generation_tokens) == (5, 3)
    assert a.mean_time_per_output_token == pytest.approx(0.75)
    (b,) = aborted.finished_requests
    assert (b.finish_reason, b.e2e_latency, b.queued_time) == ("abort", 2.5, 0.25)
    assert tracker.requests == {}


def test_prometheus_logger_exposes_vllm_names_and_values() -> None:
    registry = CollectorRegistry()
    prom = PrometheusStatLogger("m", registry)
    stats = _run_two_requests(RequestStatsTracker())
    prom.record(
        SchedulerStats(
            num_running_reqs=2,
            num_waiting_reqs=1,
            kv_cache_usage=0.25,
            kv_cache_blocks_in_use=5,
            prefix_cache_queries=16,
            prefix_cache_hits=8,
            num_preemptions=1,
        ),
        stats[0],
    )
    for it in stats[1:]:
        prom.record(SchedulerStats(num_preemptions=3), it)

    text = generate_latest(registry).decode()
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "kv_cache_blocks_in_use",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "num_preemptions_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "request_success_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_count",
        "time_per_output_token_seconds_sum",
        "e2e_request_latency_seconds_count",
        "request_queue_time_seconds_count",
    ):
        assert f"kvserve:{name}" in text, name
    assert _sample(registry, "kvserve:num_requests_running") == 0  # the last record wins
    assert _sample(registry, "kvserve:kv_cache_blocks_in_use") == 0
    assert _sample(registry, "kvserve:prefix_cache_queries_total") == 16
    assert _sample(registry, "kvserve:prefix_cache_hits_total") == 8
    assert _sample(registry, "kvserve:num_preemptions_total") == 3  # running total -> counter
    assert _sample(registry, "kvserve:prompt_tokens_total") == 8
    assert _sample(registry, "kvserve:generation_tokens_total") == 4
    assert _sample(registry, "kvserve:request_success_total", finished_reason="length") == 1
    assert _sample(registry, "kvserve:request_success_total", finished_reason="abort") == 1
    assert _sample(registry, "kvserve:time_to_first_token_seconds_count") == 2
    assert _sample(registry, "kvserve:time_to_first_token_seconds_sum") == 1.5
    assert _sample(registry, "kvserve:inter_token_latency_seconds_count") == 2
    assert _sample(registry, "kvserve:e2e_request_latency_seconds_sum") == 5.0
    assert _sample(registry, "kvserve:request_queue_time_seconds_sum") == 0.5
    # Only a with 3 tokens has a time per output token.
    assert _sample(registry, "kvserve:time_per_output_token_seconds_count") == 1


def test_prometheus_logger_can_be_built_twice_on_one_registry() -> None:
    registry = CollectorRegistry()
    first = PrometheusStatLogger("m", registry)
    first.record(SchedulerStats(num_running_reqs=4), None)
    second = PrometheusStatLogger("m", registry)  # would raise "Duplicated timeseries"
    assert _sample(registry, "kvserve:num_requests_running") is None
    second.record(SchedulerStats(num_running_reqs=2), None)
    assert _sample(registry, "kvserve:num_requests_running") == 2
    second.unregister()
    assert "kvserve:" not in generate_latest(registry).decode()


def test_logging_stat_logger_line(caplog: pytest.LogCaptureFixture) -> None:
    stat_logger = LoggingStatLogger()
    stats = _run_two_requests(RequestStatsTracker())
    stat_logger.record(
        SchedulerStats(
            num_running_reqs=3,
            num_waiting_reqs=2,
            kv_cache_usage=0.5,
            prefix_cache_queries=10,
            prefix_cache_hits=4,
        ),
        stats[0],
    )
    line = stat_logger.format_line(stat_logger.last_log_time + 2.0)
    assert "Avg prompt throughput: 4.0 tokens/s" in line
    assert "Avg generation throughput: 1.0 tokens/s" in line
    assert "Running: 3 reqs, Waiting: 2 reqs" in line
    assert "KV cache usage: 50.0%" in line and "Prefix cache hit rate: 40.0%" in line
    with caplog.at_level(logging.INFO, logger="kvserve.metrics.loggers"):
        stat_logger.log()
        stat_logger.record(SchedulerStats(), None)
        stat_logger.log()  # the first idle line is logged...
        stat_logger.log()  # ...then silence while idle
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "Running: 0 reqs" in lines[1]


def test_kv_connector_totals_become_counters() -> None:
    registry = CollectorRegistry()
    prom = PrometheusStatLogger("m", registry)
    first = {"tier_hits": {"local_cpu": 3.0, "redis": 1.0}, "lookup_tokens": {"hit": 512.0}}
    prom.record(SchedulerStats(kv_connector_stats=first), None)
    later = {"tier_hits": {"local_cpu": 7.0, "redis": 1.0}, "lookup_tokens": {"hit": 768.0}}
    prom.record(SchedulerStats(kv_connector_stats=later), None)
    name = "kvserve:kv_connector_tier_hits_total"
    assert _sample(registry, name, kind="local_cpu") == 7.0
    assert _sample(registry, name, kind="redis") == 1.0
    assert _sample(registry, "kvserve:kv_connector_lookup_tokens_total", kind="hit") == 768.0
    assert b"kvserve:kv_connector_tier_hits_total" in generate_latest(registry)
    # A second logger on the same registry replaces the first one's metrics cleanly.
    PrometheusStatLogger("m", registry).record(SchedulerStats(kv_connector_stats=first), None)
    assert _sample(registry, name, kind="local_cpu") == 3.0


def test_step_times_become_counters_per_phase() -> None:
    registry = CollectorRegistry()
    prom = PrometheusStatLogger("m", registry)
    phases = ("schedule", "prepare_inputs", "forward", "sample", "update", "output_processing")
    # Every phase is exported (at 0) before any step, so a scrape can always take a delta.
    for phase in phases:
        assert _sample(registry, "kvserve:step_time_seconds_total", phase=phase) == 0
    first = StepTimes(
        schedule=0.5, prepare_inputs=1.0, forward=4.0, sample=0.25, busy=6.0, num_steps=3
    )
    prom.record(SchedulerStats(step_times=first), IterationStats(output_processing_time=0.125))
    # The core sends running totals: the counters add only what is new.
    later = StepTimes(
        schedule=1.0, prepare_inputs=1.5, forward=6.0, sample=0.5, update=0.75, busy=10.0,
        num_steps=5,
    )  # fmt: skip
    prom.record(SchedulerStats(step_times=later), IterationStats(output_processing_time=0.25))
    prom.record(SchedulerStats(), None)  # a message without step times changes nothing
    expected = dict(zip(phases, (1.0, 1.5, 6.0, 0.5, 0.75, 0.375), strict=True))
    for phase, seconds in expected.items():
        assert _sample(registry, "kvserve:step_time_seconds_total", phase=phase) == seconds
    assert _sample(registry, "kvserve:engine_busy_seconds_total") == 10.0
    assert _sample(registry, "kvserve:engine_steps_total") == 5
