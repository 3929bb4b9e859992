"""StatsHistory fed the same real stats stream as the Prometheus logger: the totals agree
with /metrics' counters, and the per-second history keeps peaks, fills idle seconds and
honours `since` and the window."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from kvserve.metrics.history import StatsHistory
from kvserve.metrics.loggers import PrometheusStatLogger, StatLoggerBase
from kvserve.metrics.stats import RequestStatsTracker
from kvserve.protocol.engine_core import EngineCoreOutput, FinishReason, SchedulerStats, StepTimes


class Clock:
    """The history's time source, moved by the test."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Engine:
    """Feeds one stream of real stats records to every logger, as AsyncLLM does."""

    def __init__(self, clock: Clock, *loggers: StatLoggerBase) -> None:
        self.clock = clock
        self.loggers = loggers
        self.tracker = RequestStatsTracker()

    def step(self, at: float, outputs: list[EngineCoreOutput], stats: SchedulerStats) -> None:
        self.clock.now = at
        it = self.tracker.make_iteration_stats(outputs, now=at)
        for stat_logger in self.loggers:
            stat_logger.record(stats, it)


def test_totals_match_prometheus_and_history_keeps_peaks() -> None:
    clock = Clock(1000.2)
    history = StatsHistory("m", window_s=60, clock=clock)
    registry = CollectorRegistry()
    engine = Engine(clock, history, PrometheusStatLogger("m", registry=registry))
    engine.tracker.add_request("a", arrival_time=1000.0, num_prompt_tokens=5)
    engine.tracker.add_request("b", arrival_time=1000.1, num_prompt_tokens=3)
    connector = {"tier_hits": {"cpu": 2.0}, "tier_bytes_stored": {"cpu": 4096.0}}

    # Second 1000: both prefill; KV usage peaks at 0.5 then drops to 0.25 in the same second.
    engine.step(
        1000.4,
        [
            EngineCoreOutput(request_id="a", new_token_ids=[7]),
            EngineCoreOutput(request_id="b", new_token_ids=[8]),
        ],
        SchedulerStats(
            num_running_reqs=2,
            kv_cache_usage=0.5,
            prefix_cache_queries=8,
            prefix_cache_hits=4,
            step_times=StepTimes(busy=0.3, num_steps=1),
        ),
    )
    engine.step(
        1000.9,
        [EngineCoreOutput(request_id="b", new_token_ids=[9], finish_reason=FinishReason.STOP)],
        SchedulerStats(
            num_running_reqs=1,
            num_waiting_reqs=1,
            kv_cache_usage=0.25,
            num_preemptions=1,
            kv_connector_stats=connector,
            step_times=StepTimes(busy=0.5, num_steps=2),
        ),
    )
    # Second 1003 (1001-1002 idle): a finishes; the engine is empty again.
    engine.step(
        1003.5,
        [EngineCoreOutput(request_id="a", new_token_ids=[10], finish_reason=FinishReason.LENGTH)],
        SchedulerStats(num_preemptions=1, kv_connector_stats=connector),
    )
    clock.now = 1005.1

    snap = history.snapshot()
    totals = snap["totals"]

    def prom(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(
            f"kvserve:{name}", {"model_name": "m", "engine": "0", **labels}
        )

    assert totals["prompt_tokens"] == prom("prompt_tokens_total") == 8
    assert totals["generation_tokens"] == prom("generation_tokens_total") == 4
    assert totals["prefix_cache_queries"] == prom("prefix_cache_queries_total") == 8
    assert totals["prefix_cache_hits"] == prom("prefix_cache_hits_total") == 4
    assert totals["num_preemptions"] == prom("num_preemptions_total") == 1
    assert totals["finished_by_reason"] == {"stop": 1, "length": 1}
    assert totals["requests_finished"] == 2
    assert prom("request_success_total", finished_reason="stop") == 1
    assert totals["time_to_first_token_count"] == 2
    assert totals["time_to_first_token_sum_s"] == pytest.approx(0.4 + 0.3)
    assert snap["tiers"] == {"cpu": {"hits": 2.0, "bytes_stored": 4096.0}}
    assert prom("kv_connector_tier_bytes_stored_total", kind="cpu") == 4096.0
    assert snap["current"] == {"num_running_reqs": 0, "num_waiting_reqs": 0, "kv_cache_usage": 0}

    samples = snap["history"]
    assert [s["t"] for s in samples] == [1000, 1001, 1002, 1003, 1004]
    first = samples[0]
    assert (first["num_running_reqs"], first["num_waiting_reqs"]) == (2, 1)
    assert first["kv_cache_usage"] == 0.5  # the peak, though it ended the second at 0.25
    assert (first["prompt_tokens"], first["generation_tokens"]) == (8, 3)
    assert (first["num_preemptions"], first["requests_finished"]) == (1, 1)
    assert first["engine_busy_s"] == pytest.approx(0.5)
    # Idle seconds repeat what was in force when 1000 ended, and count nothing.
    for idle in samples[1:3]:
        assert (idle["num_running_reqs"], idle["kv_cache_usage"]) == (1, 0.25)
        assert idle["generation_tokens"] == idle["requests_finished"] == 0
    assert samples[3]["requests_finished"] == 1
    assert samples[4]["num_running_reqs"] == 0 and samples[4]["kv_cache_usage"] == 0


def test_since_and_window_bound_the_history() -> None:
    clock = Clock(500.0)
    history = StatsHistory("m", window_s=10, clock=clock)
    for second in range(500, 530):
        clock.now = second + 0.5
        history.record(SchedulerStats(num_running_reqs=second - 500), None)
    clock.now = 530.2
    ts = [s["t"] for s in history.snapshot()["history"]]
    assert ts == list(range(520, 530))  # only the window
    ts = [s["t"] for s in history.snapshot(since=526)["history"]]
    assert ts == [527, 528, 529]
    assert history.snapshot(since=529.0)["history"] == []  # 530 is still open
    with pytest.raises(ValueError, match="window_s"):
        StatsHistory("m", window_s=0)


def test_data_parallel_cores_are_shown_each_and_added_up() -> None:
    clock = Clock(1000.0)
    history = StatsHistory("m", clock=clock)
    registry = CollectorRegistry()
    prom = PrometheusStatLogger("m", registry)
    busy = StepTimes(busy=2.0)
    for logger in (history, prom):
        logger.record(
            SchedulerStats(num_running_reqs=2, kv_cache_usage=0.5, step_times=busy), None, 0
        )
        logger.record(
            SchedulerStats(num_waiting_reqs=1, prefix_cache_queries=8, prefix_cache_hits=4), None, 1
        )
        # Each core's running totals are its own: core 1's first busy total is all new.
        logger.record(SchedulerStats(step_times=StepTimes(busy=1.0)), None, 1)
    snap = history.snapshot()
    assert snap["current"] == {"num_running_reqs": 2, "num_waiting_reqs": 0, "kv_cache_usage": 0.25}
    assert [
        (e["engine"], e["num_running_reqs"], e["prefix_cache_hits"], e["busy_s"])
        for e in snap["engines"]
    ] == [
        (0, 2, 0, 2.0),
        (1, 0, 4, 1.0),
    ]
    assert (
        registry.get_sample_value(
            "kvserve:engine_busy_seconds_total", {"model_name": "m", "engine": "0"}
        )
        == 2.0
    )
    assert (
        registry.get_sample_value(
            "kvserve:engine_busy_seconds_total", {"model_name": "m", "engine": "1"}
        )
        == 1.0
    )
    assert (
        registry.get_sample_value(
            "kvserve:num_requests_running", {"model_name": "m", "engine": "0"}
        )
        == 2
    )
    assert (
        registry.get_sample_value(
            "kvserve:prefix_cache_hits_total", {"model_name": "m", "engine": "1"}
        )
        == 4
    )
