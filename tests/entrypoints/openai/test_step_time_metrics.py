"""The served engine exports where its step time goes: per phase, busy time and steps."""

from __future__ import annotations

import httpx
import pytest

from kvserve.benchmarks.step_times import PHASES, StepTimeTotals, parse_step_times
from tests.entrypoints.openai.utils import RemoteServer

pytestmark = pytest.mark.slow


def _totals(server: RemoteServer) -> StepTimeTotals:
    totals = parse_step_times(httpx.get(server.url("/metrics"), timeout=10).text)
    assert totals is not None, "no kvserve:step_time_seconds_total in /metrics"
    return totals


def test_step_time_counters_grow_with_a_request(server: RemoteServer) -> None:
    before = _totals(server)
    assert set(PHASES) == set(before.phases)  # every phase is exported from the start
    server.client().completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="Once upon a time",
        max_tokens=5,
        extra_body={"ignore_eos": True},
    )
    after = _totals(server)
    # A prefill and four decodes at least, each running every phase.
    assert after.steps - before.steps >= 5
    assert after.busy > before.busy
    for phase in PHASES:
        assert after.phases[phase] > before.phases[phase], phase
    # The core's phases are parts of its busy time (output processing is the front end's).
    core = sum(after.phases[p] - before.phases[p] for p in PHASES if p != "output_processing")
    assert core <= after.busy - before.busy
