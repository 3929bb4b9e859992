"""Short soaks against real `kvserve serve` processes, and the soak's RSS trend and plot.

The basic mix: two rounds of 32 misbehaving clients (streams, plain requests, disconnects,
aborts and malformed requests for ~10 s per round). Each round must end with no error of
any kind (a 5xx, a refused good request, a served bad one, a timeout), every KV block
free, the server healthy and the same engine core alive; RSS may not keep growing from
the first round to the second. The feature mix: one round against a server with ngram
speculation and the hermes tool call parser, where every feature's checked reply (JSON
schema, forced tool call, n=2 with logprobs, seeded sampling, shared prefixes under
cache salts) must occur with no error. Then the trend's arithmetic on a synthetic series,
and `--plot` (from saved reports, one compared with another) writing a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve.benchmarks import soak
from kvserve.benchmarks.soak import SoakConfig, require_loopback, run_soak
from kvserve.benchmarks.soak_features import ITEM_SCHEMA, schema_problem, shared_prefixes
from kvserve.benchmarks.soak_monitor import rss_trend, trend_window_s
from tests.entrypoints.openai.utils import RemoteServer

pytestmark = pytest.mark.slow

# Short prompts and outputs: many requests (and drops) per client in a CPU-bound round.
ROUND = SoakConfig(
    clients=32,
    duration_s=10.0,
    max_tokens=8,
    max_prompt_words=12,
    request_timeout_s=90.0,
    mix="basic",
)
# The test server's 512-token context holds the longest shared prefix (240 words) and a
# reply; its model takes no images. 12 s after the warmup: the RSS trend needs 10+ samples.
FEATURE_ROUND = SoakConfig(
    clients=24,
    duration_s=20.0,
    max_tokens=8,
    max_prompt_words=12,
    request_timeout_s=90.0,
    images="off",
    prefix_words=160,
    warmup_s=8.0,
)
FEATURE_OUTCOMES = ("json_schema", "tool_call", "n2_logprobs", "seeded", "shared_prefix")
# Per process, from the end of round 1 to the end of round 2: allocator noise, not a leak.
RSS_GROWTH_MIB = 64.0


@pytest.fixture(scope="module")
def soak_server() -> Iterator[RemoteServer]:
    remote = RemoteServer()
    yield remote
    remote.stop()


@pytest.fixture(scope="module")
def feature_server() -> Iterator[RemoteServer]:
    # Room for the nine salted prefixes (~2000 tokens) beside 24 requests' own KV: the
    # 96 MiB of RemoteServer's default holds ~2200 tokens, where they would evict each other.
    remote = RemoteServer(
        "--kv-cache-memory", "384M",
        "--speculative-config", json.dumps(soak.SPECULATIVE_CONFIG),
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    )  # fmt: skip
    yield remote
    remote.stop()


def _check_round(report: dict) -> None:
    assert report["errors"] == {}, report["error_examples"]
    outcomes = report["outcomes"]
    for outcome in ("served", "rejected", "disconnected", "aborted"):
        assert outcomes.get(outcome, 0) > 0, f"no {outcome} requests: {outcomes}"
    assert report["kv_blocks_in_use"] == 0, "KV blocks leaked"
    assert report["num_requests_running"] == 0
    assert report["healthy"] and report["lost_processes"] == []
    assert set(report["peak_rss_mib"]) == {"api_server", "engine_core"}


def test_two_soak_rounds_leave_the_server_healthy_and_leak_free(
    soak_server: RemoteServer,
) -> None:
    pid = soak_server.proc.pid
    first = asyncio.run(run_soak(soak_server.base_url, ROUND, pid))
    print("soak round 1:", first)
    _check_round(first)
    second = asyncio.run(run_soak(soak_server.base_url, ROUND, pid))
    print("soak round 2:", second)
    _check_round(second)
    for role, end_rss in second["end_rss_mib"].items():
        growth = end_rss - first["end_rss_mib"][role]
        assert growth < RSS_GROWTH_MIB, f"{role} grew {growth:.0f} MiB in the second round"


def test_the_soak_refuses_non_loopback_targets_and_unbounded_runs() -> None:
    with pytest.raises(ValueError, match="loopback"):
        require_loopback("http://10.1.2.3:8000")
    require_loopback("http://127.0.0.1:8000")
    with pytest.raises(ValueError, match="duration_s"):
        SoakConfig(duration_s=0)
    with pytest.raises(ValueError, match="clients"):
        SoakConfig(clients=0)
    with pytest.raises(ValueError, match="mix"):
        SoakConfig(mix="everything")
    with pytest.raises(ValueError, match="warmup_s"):
        SoakConfig(duration_s=60, warmup_s=60)
    assert SoakConfig(duration_s=1800).warmup == 300
    assert SoakConfig(duration_s=60).warmup == 20


def test_a_feature_mix_round_gets_every_checked_reply_and_no_error(
    feature_server: RemoteServer,
) -> None:
    report = asyncio.run(run_soak(feature_server.base_url, FEATURE_ROUND, feature_server.proc.pid))
    series = report.pop("rss_series")
    print("feature round:", report)
    assert report["errors"] == {}, report["error_examples"]
    outcomes = report["outcomes"]
    # A seeded request sent twice (and checked for the same text) counts as seeded_repeated.
    outcomes["seeded"] = outcomes.get("seeded", 0) + outcomes.get("seeded_repeated", 0)
    for outcome in (*FEATURE_OUTCOMES, "served", "rejected", "disconnected", "aborted"):
        assert outcomes.get(outcome, 0) > 0, f"no {outcome}: {outcomes}"
    assert report["kv_blocks_in_use"] == 0, "KV blocks leaked"
    assert report["healthy"] and report["lost_processes"] == []
    assert report["images"] == {"mode": "off", "enabled": False}
    assert set(report["rss"]) == set(series) == {"api_server", "engine_core"}
    for role, trend in report["rss"].items():
        after_warmup = [t for t, _ in series[role] if t >= FEATURE_ROUND.warmup]
        assert trend["samples"] == len(after_warmup) >= 10
        assert trend["growth_pct"] is not None and trend["slope_mib_per_min"] is not None
        assert trend["peak_mib"] >= max(mib for _, mib in series[role])


def test_the_trend_reads_growth_and_slope_after_the_warmup_only() -> None:
    # 10 minutes at 1 s: a climb to 1000 MiB in the 5-minute warm-up, then +2 MiB a minute.
    series = [
        (t, 500 + t * 500 / 300 if t < 300 else 1000 + 2 * (t - 300) / 60) for t in range(601)
    ]
    window = trend_window_s(elapsed_s=600, warmup_s=300)
    assert window == 60
    trend = rss_trend(series, warmup_s=300, window_s=window)
    assert trend["samples"] == 301
    assert trend["slope_mib_per_min"] == pytest.approx(2.0, abs=1e-6)
    # Means over [300, 360] s and [540, 600] s: 1001 and 1009 MiB.
    assert trend["rss_start_mib"] == pytest.approx(1001.0)
    assert trend["rss_end_mib"] == pytest.approx(1009.0)
    assert trend["growth_pct"] == pytest.approx(800 / 1001, abs=1e-3)
    flat = rss_trend([(t, 2048.0 + (t % 2)) for t in range(400)], warmup_s=100, window_s=60)
    assert abs(flat["slope_mib_per_min"]) < 0.01 and abs(flat["growth_pct"]) < 0.01
    # A short run's ends do not overlap; no samples after the warm-up gives no trend.
    assert trend_window_s(elapsed_s=30, warmup_s=9) == 7
    assert rss_trend(series[:100], warmup_s=300, window_s=60)["growth_pct"] is None


def _saved_report(path: Path, growth_mib_per_min: float) -> Path:
    series = {
        "api_server": [(t, 300 + growth_mib_per_min * t / 600) for t in range(0, 180, 2)],
        "engine_core": [(t, 2000 + growth_mib_per_min * t / 60) for t in range(0, 180, 2)],
    }
    rss = {
        role: {"peak_mib": max(v for _, v in s), **rss_trend(s, 60, 40)}
        for role, s in series.items()
    }
    report = {"clients": 24, "mix": "features", "duration_s": 180, "rss_warmup_s": 60}
    path.write_text(json.dumps({**report, "rss": rss, "rss_series": series}))
    return path


def test_plot_draws_a_saved_run_against_another_as_a_png(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    soak.add_cli_args(parser)
    after = _saved_report(tmp_path / "after.json", 0.0)
    before = _saved_report(tmp_path / "before.json", 3.0)
    png = tmp_path / "rss.png"
    flags = ["--from-json", str(after), "--plot", str(png)]
    args = parser.parse_args([*flags, "--compare-json", str(before), "--compare-label", "before"])
    assert soak.main(args) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    with pytest.raises(SystemExit, match="--plot"):
        soak.main(parser.parse_args(["--from-json", str(after)]))


def test_the_feature_checks_catch_wrong_answers() -> None:
    assert schema_problem({"name": "kettle", "count": 3}, ITEM_SCHEMA) is None
    assert "missing" in (schema_problem({"name": "kettle"}, ITEM_SCHEMA) or "")
    assert "integer" in (schema_problem({"name": "a", "count": True}, ITEM_SCHEMA) or "")
    assert "outside" in (schema_problem({"name": "a", "count": 1000}, ITEM_SCHEMA) or "")
    assert "unexpected" in (schema_problem({"name": "a", "count": 1, "x": 0}, ITEM_SCHEMA) or "")
    prefixes = shared_prefixes(160)
    assert [len(p.split()) for p in prefixes] == [160, 200, 240]
    # Computed again (in another client process, in another run): the same text.
    assert prefixes == shared_prefixes.__wrapped__(160)
