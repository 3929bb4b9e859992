"""Where a kvserve server's time went during a `kvserve bench serve` run.

The server exports running totals (``kvserve:step_time_seconds_total{phase=...}``,
``kvserve:engine_busy_seconds_total``, ``kvserve:engine_steps_total``); the bench scrapes
/metrics right before and right after its timed region and reports each phase's share of
the run's wall time and of the engine core's busy time. A server without these metrics
(another engine) simply gets no breakdown.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

PHASES = ("schedule", "prepare_inputs", "forward", "sample", "update", "output_processing")
# Everything but the model forward: the per-step cost the engine adds around the model.
OVERHEAD_PHASES = tuple(p for p in PHASES if p != "forward")
OVERHEAD_LABEL = "overhead (scheduler + input preparation + output processing)"


@dataclass
class StepTimeTotals:
    phases: dict[str, float]
    busy: float
    steps: float


def parse_step_times(text: str) -> StepTimeTotals | None:
    """Totals summed over every label but phase (model_name); None when not exported."""
    phases: dict[str, float] = {}
    busy = steps = 0.0
    found = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvserve:step_time_seconds_total":
                phase = sample.labels.get("phase", "")
                phases[phase] = phases.get(phase, 0.0) + sample.value
                found = True
            elif sample.name == "kvserve:engine_busy_seconds_total":
                busy += sample.value
            elif sample.name == "kvserve:engine_steps_total":
                steps += sample.value
    return StepTimeTotals(phases, busy, steps) if found else None


async def scrape_step_times(client: httpx.AsyncClient, base_url: str) -> StepTimeTotals | None:
    try:
        response = await client.get(base_url.rstrip("/") + "/metrics", timeout=10.0)
        if response.status_code != 200:
            return None
        return parse_step_times(response.text)
    except (httpx.HTTPError, ValueError):
        return None  # no /metrics, or not Prometheus text: not a kvserve server


def step_time_breakdown(
    before: StepTimeTotals | None, after: StepTimeTotals | None, wall_s: float
) -> dict[str, Any] | None:
    """Seconds per phase over the run and their shares of wall and engine-busy time.

    output_processing runs in the server's front-end process, beside the engine core, so
    its "busy share" is a ratio to the core's busy time rather than a part of it.
    """
    if before is None or after is None:
        return None
    seconds = {p: max(after.phases.get(p, 0.0) - before.phases.get(p, 0.0), 0.0) for p in PHASES}
    busy = max(after.busy - before.busy, 0.0)
    wall = max(wall_s, 1e-9)
    overhead = sum(seconds[p] for p in OVERHEAD_PHASES)
    return {
        "wall_s": wall_s,
        "engine_busy_s": busy,
        "engine_steps": round(max(after.steps - before.steps, 0.0)),
        "engine_busy_wall_share": busy / wall,
        "step_time_s": seconds,
        "wall_share": {p: v / wall for p, v in seconds.items()},
        "busy_share": {p: v / busy if busy else None for p, v in seconds.items()},
        "overhead_phases": list(OVERHEAD_PHASES),
        "overhead_s": overhead,
        "overhead_wall_share": overhead / wall,
        "overhead_busy_share": overhead / busy if busy else None,
    }


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f}%"


def print_step_time_breakdown(b: dict[str, Any] | None) -> None:
    print("{s:{c}^52}".format(s=" Server Step Time ", c="-"))
    if b is None:
        print("not available: the server exports no kvserve:step_time_seconds_total")
        return
    print(f"{'phase':<20}{'seconds':>10}{'% wall':>11}{'% busy':>11}")
    for phase in PHASES:
        print(
            f"{phase:<20}{b['step_time_s'][phase]:>10.3f}"
            f"{_pct(b['wall_share'][phase]):>11}{_pct(b['busy_share'][phase]):>11}"
        )
    steps = b["engine_steps"]
    mean_ms = 1000 * b["engine_busy_s"] / steps if steps else 0.0
    print(
        f"engine busy: {b['engine_busy_s']:.3f} s of {b['wall_s']:.3f} s wall "
        f"({_pct(b['engine_busy_wall_share'])}), {steps} steps, {mean_ms:.2f} ms/step"
    )
    print(
        f"{OVERHEAD_LABEL}: {_pct(b['overhead_wall_share'])} of wall time "
        f"({_pct(b['overhead_busy_share'])} of engine busy time)"
    )
