"""bench serve's step-time breakdown from two /metrics scrapes (no server needed)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvserve.benchmarks.step_times import (
    OVERHEAD_LABEL,
    parse_step_times,
    print_step_time_breakdown,
    step_time_breakdown,
)
from kvserve.metrics.loggers import PrometheusStatLogger
from kvserve.metrics.stats import IterationStats
from kvserve.protocol.engine_core import SchedulerStats, StepTimes


def test_breakdown_from_the_loggers_own_exposition(capsys: pytest.CaptureFixture[str]) -> None:
    registry = CollectorRegistry()
    prom = PrometheusStatLogger("m", registry)
    before = parse_step_times(generate_latest(registry).decode())
    assert before is not None and before.phases["forward"] == 0.0
    totals = StepTimes(
        schedule=0.25, prepare_inputs=0.5, forward=6.0, sample=0.25, update=0.25, busy=8.0,
        num_steps=100,
    )  # fmt: skip
    prom.record(SchedulerStats(step_times=totals), IterationStats(output_processing_time=0.75))
    after = parse_step_times(generate_latest(registry).decode())

    b = step_time_breakdown(before, after, wall_s=10.0)
    assert b is not None
    assert b["step_time_s"]["forward"] == 6.0 and b["engine_steps"] == 100
    assert b["wall_share"]["schedule"] == pytest.approx(0.025)
    assert b["busy_share"]["forward"] == pytest.approx(0.75)
    # Everything but the forward: 0.25 + 0.5 + 0.25 + 0.25 + 0.75 = 2.0 s.
    assert b["overhead_s"] == pytest.approx(2.0)
    assert b["overhead_wall_share"] == pytest.approx(0.2)
    assert b["overhead_busy_share"] == pytest.approx(0.25)
    print_step_time_breakdown(b)
    printed = capsys.readouterr().out
    assert f"{OVERHEAD_LABEL}: 20.0% of wall time (25.0% of engine busy time)" in printed
    assert "100 steps, 80.00 ms/step" in printed


def test_no_breakdown_without_the_metrics(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        parse_step_times("# HELP other_total x\n# TYPE other_total counter\nother_total 1\n")
        is None
    )
    assert step_time_breakdown(None, None, 1.0) is None
    print_step_time_breakdown(None)
    assert "not available" in capsys.readouterr().out
