"""Repeated rounds of `kvserve bench peers`, for machines whose speed drifts.

On a shared VM the same engine can run at half speed one minute and full speed the next
(other tenants' load), so one pass can put two engines in different weather. With
``--rounds N`` every engine runs every workload N times, round by round (all engines in
round 1, then all in round 2, ...). Each engine's reported row is its median round, and
engines are compared round by round: the ratio of two engines within a round, taken
minutes apart at most, is reported as the median over rounds with its range.
"""

from __future__ import annotations

import statistics

from kvserve.benchmarks.peers_workloads import KVSERVE_ENGINES, EngineResult

PEER_ENGINES = ("hf", "llamacpp")


def median_round(runs: list[EngineResult]) -> EngineResult:
    """The run with the median output rate (the lower middle one for an even count), with
    every round's rate attached."""
    ordered = sorted(runs, key=lambda r: r.output_tok_s)
    chosen = ordered[(len(ordered) - 1) // 2]
    chosen.extra["rounds_output_tok_s"] = [round(r.output_tok_s, 2) for r in runs]
    return chosen


def combine_rounds(rounds: list[list[EngineResult]]) -> tuple[list[EngineResult], list[str]]:
    """Per (engine, workload), its median round; and a note per kvserve engine and peer
    with the median (min-max) of their same-round output rate ratios."""
    keys: list[tuple[str, str]] = []
    runs: dict[tuple[str, str], list[EngineResult | None]] = {}
    for i, results in enumerate(rounds):
        for r in results:
            key = (r.engine, r.workload)
            if key not in runs:
                keys.append(key)
                runs[key] = [None] * len(rounds)
            runs[key][i] = r
    combined = [median_round([r for r in runs[k] if r is not None]) for k in keys]
    if len(rounds) < 2:
        return combined, []
    notes = []
    for engine, workload in keys:
        if engine not in KVSERVE_ENGINES:
            continue
        for peer in PEER_ENGINES:
            pairs = zip(runs[(engine, workload)], runs.get((peer, workload), []), strict=False)
            ratios = [a.output_tok_s / b.output_tok_s for a, b in pairs if a and b]
            if len(ratios) < 2:
                continue
            notes.append(
                f"workload {workload}: {engine} / {peer} output tok/s, same-round ratio over "
                f"{len(ratios)} rounds: median {statistics.median(ratios):.2f} "
                f"(min {min(ratios):.2f}, max {max(ratios):.2f})"
            )
    return combined, notes
