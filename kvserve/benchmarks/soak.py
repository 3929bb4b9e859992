"""`kvserve bench soak`: many misbehaving clients against one loopback server, for a set time.

N concurrent clients (soak_clients.py) stream and post requests of random lengths, drop
streams, abort requests and send malformed ones until the duration or the request cap
runs out; the `features` mix (soak_features.py, the default) adds structured outputs,
tool calls, n=2 with logprobs, seeded sampling, long shared prefixes under three cache
salts and, when the model takes them, images, each reply checked. Then it reports
requests served, errors by kind, p50/p99 latency, the RSS of the server, its engine-core
child and their workers (peak, and after a warm-up the start and end level, growth and
slope: soak_monitor.py), the KV blocks still in use (from kvserve:kv_cache_blocks_in_use,
after a final probe request; 0 unless blocks leaked) and whether the server is still
healthy (/health, the probe, the same engine core). It starts its own `kvserve serve` on
127.0.0.1, or soaks a loopback --url; `--plot` draws the RSS series (soak_plot.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvserve.benchmarks.soak_clients import ClientPlan, SoakTally, run_client
from kvserve.benchmarks.soak_features import IMAGE_MODES, MIX_NAMES, build_mix, probe_images
from kvserve.benchmarks.soak_monitor import RssSampler, rss_trend, trend_window_s
from kvserve.benchmarks.soak_plot import load_report, plot_rss
from kvserve.benchmarks.soak_replies import SoakError
from kvserve.benchmarks.step_times import scrape_step_times
from kvserve.utils.health import wait_until_healthy
from kvserve.utils.processes import free_port

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}
MAX_DURATION_S = 4 * 3600.0
MAX_WARMUP_S = 300.0
BASIC_SERVER_ARGS = "--max-num-seqs 64 --disable-log-requests --uvicorn-log-level warning"
# The server the feature mix needs: ngram speculation under every request, and the tool
# call parser for its tool_choice "auto" requests.
SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
FEATURE_SERVER_ARGS = (
    f"{BASIC_SERVER_ARGS} --speculative-config {shlex.quote(json.dumps(SPECULATIVE_CONFIG))}"
    " --enable-auto-tool-choice --tool-call-parser hermes"
)


@dataclass
class SoakConfig:
    clients: int = 64
    duration_s: float = 60.0
    max_requests: int = 100_000
    max_tokens: int = 24
    max_prompt_words: int = 48
    request_timeout_s: float = 120.0
    seed: int = 0
    mix: str = "features"
    images: str = "auto"  # auto: probe the server once; on; off
    prefix_words: int = 400  # the shortest shared system prompt of the feature mix
    warmup_s: float | None = None  # None: min(300 s, a third of the duration)
    rss_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.clients <= 1024:
            raise ValueError(f"clients must be in [1, 1024], got {self.clients}")
        if not 0 < self.duration_s <= MAX_DURATION_S:
            raise ValueError(f"duration_s must be in (0, {MAX_DURATION_S}], got {self.duration_s}")
        if self.max_requests < 1 or self.max_tokens < 1 or self.max_prompt_words < 1:
            raise ValueError("max_requests, max_tokens and max_prompt_words must be positive")
        if self.mix not in MIX_NAMES:
            raise ValueError(f"mix must be one of {', '.join(MIX_NAMES)}, got {self.mix!r}")
        if self.images not in IMAGE_MODES:
            raise ValueError(f"images must be one of {', '.join(IMAGE_MODES)}, got {self.images!r}")
        if self.prefix_words < 1:
            raise ValueError(f"prefix_words must be positive, got {self.prefix_words}")
        if self.warmup_s is not None and not 0 <= self.warmup_s < self.duration_s:
            raise ValueError(f"warmup_s must be in [0, duration_s), got {self.warmup_s}")
        if not self.rss_interval_s > 0:
            raise ValueError(f"rss_interval_s must be positive, got {self.rss_interval_s}")

    @property
    def warmup(self) -> float:
        if self.warmup_s is not None:
            return self.warmup_s
        return min(MAX_WARMUP_S, self.duration_s / 3)


def require_loopback(base_url: str) -> None:
    host = urlsplit(base_url).hostname
    if host not in LOOPBACK_HOSTS:
        raise ValueError(f"the soak only targets loopback servers, not {host!r}")


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    """`kvserve:*` samples by name, labels dropped (one model per server)."""
    text = (await client.get("/metrics", timeout=10.0)).text
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("kvserve:")
    }


async def final_checks(client: httpx.AsyncClient, model: str, timeout_s: float) -> dict[str, Any]:
    """Waits for the server to drain, sends a probe, reads blocks in use and /health."""
    deadline = time.monotonic() + timeout_s
    metrics = await scrape(client)
    while metrics.get("kvserve:num_requests_running", 0) or metrics.get(
        "kvserve:num_requests_waiting", 0
    ):
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
        metrics = await scrape(client)
    # The probe's last step frees its own blocks, then the core reports what is still held.
    probe = await client.post(
        "/v1/completions", json={"model": model, "prompt": "ok", "max_tokens": 1}, timeout=60
    )
    metrics = await scrape(client)
    health = await client.get("/health", timeout=10)
    return {
        "probe_status": probe.status_code,
        "health_status": health.status_code,
        "kv_blocks_in_use": metrics.get("kvserve:kv_cache_blocks_in_use"),
        "num_requests_running": metrics.get("kvserve:num_requests_running"),
    }


def _rate(before: dict[str, float], after: dict[str, float], name: str, secs: float) -> float:
    key = "kvserve:" + name
    return round((after.get(key, 0.0) - before.get(key, 0.0)) / secs, 1)


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if values else None


async def _images(
    client: httpx.AsyncClient, config: SoakConfig, model: str, tally: SoakTally
) -> dict[str, Any]:
    """Whether the feature mix sends images (its `images` report entry)."""
    if config.mix != "features" or config.images == "off":
        return {"mode": config.images, "enabled": False}
    if config.images == "on":
        return {"mode": "on", "enabled": True}
    try:
        enabled, answer = await probe_images(client, model)
    except SoakError as exc:
        tally.error(exc.kind, str(exc))
        return {"mode": "auto", "enabled": False, "probe": str(exc)[:300]}
    return {"mode": "auto", "enabled": enabled, "probe": answer}


def rss_report(
    sampler: RssSampler, elapsed_s: float, warmup_s: float
) -> tuple[dict[str, dict[str, Any]], float]:
    """Per role: the peak and the trend after the warm-up; and the averaging window."""
    window = trend_window_s(elapsed_s, warmup_s)
    peaks = sampler.peak_mib()
    report = {
        role: {"peak_mib": peaks.get(role), **rss_trend(points, warmup_s, window)}
        for role, points in sampler.series_mib().items()
    }
    return report, round(window, 2)


async def run_soak(base_url: str, config: SoakConfig, server_pid: int | None = None) -> dict:
    """One soak round against a running loopback server; returns the report (with the RSS
    series under "rss_series" when server_pid is given)."""
    require_loopback(base_url)
    limits = httpx.Limits(max_connections=config.clients + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=config.request_timeout_s, limits=limits
    ) as client:
        model = (await client.get("/v1/models", timeout=10)).json()["data"][0]["id"]
        tally = SoakTally()
        images = await _images(client, config, model, tally)
        mix = build_mix(config.mix, images["enabled"])
        sampler = (
            RssSampler(server_pid, series_interval_s=config.rss_interval_s)
            if server_pid is not None
            else None
        )
        busy_before = await scrape_step_times(client, base_url)
        before = await scrape(client)
        start = time.monotonic()
        sampling = asyncio.create_task(sampler.run(start)) if sampler else None
        plan = ClientPlan(
            model=model,
            deadline=start + config.duration_s,
            max_requests=config.max_requests,
            max_tokens=config.max_tokens,
            max_prompt_words=config.max_prompt_words,
            request_timeout_s=config.request_timeout_s,
            prefix_words=config.prefix_words,
        )
        rng = random.Random(config.seed)
        await asyncio.gather(
            *(
                run_client(client, plan, tally, random.Random(rng.getrandbits(64)), mix)
                for _ in range(config.clients)
            )
        )
        elapsed = time.monotonic() - start
        busy_after = await scrape_step_times(client, base_url)
        after = await scrape(client)
        checks = await final_checks(client, model, timeout_s=60.0)
        if sampler is not None and sampling is not None:
            sampling.cancel()
            sampler.sample()
        total_s = time.monotonic() - start
    healthy = checks["probe_status"] == 200 and checks["health_status"] == 200
    if sampler is not None:
        healthy = healthy and not sampler.lost
    rss, window = rss_report(sampler, total_s, config.warmup) if sampler else ({}, None)
    report = {
        "clients": config.clients,
        "mix": config.mix,
        "images": images,
        "duration_s": round(elapsed, 2),
        "requests": tally.started,
        "outcomes": dict(tally.outcomes),
        "requests_per_s": round(tally.started / elapsed, 2),
        "errors": dict(tally.errors),
        "error_examples": tally.error_examples,
        "latency_p50_s": _pct(tally.latencies_s, 50),
        "latency_p99_s": _pct(tally.latencies_s, 99),
        "ttft_p50_s": _pct(tally.ttfts_s, 50),
        "ttft_p99_s": _pct(tally.ttfts_s, 99),
        # What the engine computed for all requests, dropped ones included.
        "prompt_tokens_per_s": _rate(before, after, "prompt_tokens_total", elapsed),
        "generation_tokens_per_s": _rate(before, after, "generation_tokens_total", elapsed),
        # Near 1: the engine core computed all along (the run was bound by its compute).
        "engine_busy_fraction": (
            round((busy_after.busy - busy_before.busy) / elapsed, 3)
            if busy_before and busy_after
            else None
        ),
        "peak_rss_mib": sampler.peak_mib() if sampler else None,
        "end_rss_mib": sampler.last_mib() if sampler else None,
        "rss_warmup_s": round(config.warmup, 2),
        "rss_window_s": window,
        "rss": rss,
        "lost_processes": sampler.lost if sampler else None,
        **checks,
        "healthy": healthy,
    }
    if sampler is not None:
        report["rss_series"] = sampler.series_mib()
    return report


def start_server(
    server_args: list[str], log_path: str, timeout_s: float = 300.0
) -> tuple[subprocess.Popen, str]:
    """`kvserve serve` on a free 127.0.0.1 port (output to log_path), once /health is 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve"]
    cmd += [*server_args, "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )
    base_url = f"http://127.0.0.1:{port}"
    if wait_until_healthy(base_url, proc, time.monotonic() + timeout_s, interval_s=0.5):
        return proc, base_url
    proc.terminate()
    proc.wait(timeout=60)
    raise RuntimeError(
        f"the server did not become healthy (exit code {proc.returncode}); see {log_path}"
    )


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    d = SoakConfig()
    parser.add_argument("--clients", type=int, default=d.clients)
    parser.add_argument("--duration", type=float, default=d.duration_s, help="seconds")
    parser.add_argument("--max-requests", type=int, default=d.max_requests)
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens, help="upper bound")
    parser.add_argument("--max-prompt-words", type=int, default=d.max_prompt_words)
    parser.add_argument("--request-timeout", type=float, default=d.request_timeout_s)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument(
        "--mix",
        choices=MIX_NAMES,
        default=d.mix,
        help="basic: streams, plain requests, drops, aborts, malformed requests; features: "
        "those plus json_schema replies, forced tool calls, n=2 with logprobs, seeded "
        "sampling, shared prefixes under three cache salts, images if the model takes them",
    )
    parser.add_argument(
        "--images",
        choices=IMAGE_MODES,
        default=d.images,
        help="features mix: auto sends one image first and adds images if it is served",
    )
    parser.add_argument(
        "--prefix-words",
        type=int,
        default=d.prefix_words,
        help="words of the shortest shared system prompt (the others are 1.25x and 1.5x)",
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds before the RSS trend counts (default: min(300, duration / 3))",
    )
    parser.add_argument(
        "--rss-interval",
        type=float,
        default=d.rss_interval_s,
        help="seconds between the RSS series' samples (the peak is sampled every 0.25 s)",
    )
    parser.add_argument(
        "--max-rss-growth-pct",
        type=float,
        default=None,
        help="exit 1 if any process's RSS grew by this many percent or more after the warm-up",
    )
    parser.add_argument(
        "--url", default=None, help="soak a running loopback server instead of starting one"
    )
    parser.add_argument("--server-pid", type=int, default=None, help="its pid, for RSS (--url)")
    parser.add_argument(
        "--server-args",
        default=None,
        help="flags for the `kvserve serve` the soak starts (one string); default for --mix "
        f"basic: {BASIC_SERVER_ARGS!r}; features adds ngram speculation and the hermes "
        "tool call parser",
    )
    parser.add_argument("--server-log", default=None, help="default: a file under /tmp")
    parser.add_argument("--output-json", default=None, help="the report with the RSS series")
    parser.add_argument("--plot", default=None, help="PNG of RSS per process over time")
    parser.add_argument(
        "--from-json", default=None, help="with --plot: draw a saved --output-json, run nothing"
    )
    parser.add_argument("--label", default=None, help="this run's name in the plot's legend")
    parser.add_argument(
        "--compare-json", default=None, help="with --plot: a second saved run, drawn dashed"
    )
    parser.add_argument("--compare-label", default=None)


def _label(label: str | None, path: str | None, fallback: str) -> str:
    if label:
        return label
    return os.path.splitext(os.path.basename(path))[0] if path else fallback


def _plot(args: argparse.Namespace, report: dict[str, Any]) -> None:
    runs = [(_label(args.label, args.from_json, "this run"), report)]
    if args.compare_json:
        other = load_report(args.compare_json)
        runs.append((_label(args.compare_label, args.compare_json, "other run"), other))
    plot_rss(runs, args.plot)
    print(f"plot: {args.plot}", file=sys.stderr)


def main(args: argparse.Namespace) -> int:
    if args.from_json:
        if not args.plot:
            raise SystemExit("--from-json only draws a saved run: give --plot PATH")
        _plot(args, load_report(args.from_json))
        return 0
    if args.plot and args.url is not None and args.server_pid is None:
        raise SystemExit("--plot needs the server's pid for its RSS: give --server-pid")
    config = SoakConfig(
        clients=args.clients,
        duration_s=args.duration,
        max_requests=args.max_requests,
        max_tokens=args.max_tokens,
        max_prompt_words=args.max_prompt_words,
        request_timeout_s=args.request_timeout,
        seed=args.seed,
        mix=args.mix,
        images=args.images,
        prefix_words=args.prefix_words,
        warmup_s=args.warmup,
        rss_interval_s=args.rss_interval,
    )
    proc = None
    if args.url is None:
        log_path = args.server_log or tempfile.mkstemp(prefix="kvserve-soak-", suffix=".log")[1]
        print(f"server log: {log_path}", file=sys.stderr)
        server_args = args.server_args
        if server_args is None:
            server_args = FEATURE_SERVER_ARGS if config.mix == "features" else BASIC_SERVER_ARGS
        proc, base_url = start_server(shlex.split(server_args), log_path)
        pid: int | None = proc.pid
    else:
        base_url, pid = args.url, args.server_pid
    try:
        report = asyncio.run(run_soak(base_url, config, pid))
    finally:
        if proc is not None:
            proc.terminate()
            report_exit = proc.wait(timeout=90)
    if proc is not None:
        report["server_exit_code"] = report_exit
    series = report.pop("rss_series", None)
    print(json.dumps(report, indent=2))
    if series is not None:
        report["rss_series"] = series
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(json.dumps(report, indent=1) + "\n")
    if args.plot:
        _plot(args, report)
    ok = report["healthy"] and not report["errors"] and report["kv_blocks_in_use"] == 0
    if args.max_rss_growth_pct is not None:
        growths = [r["growth_pct"] for r in report["rss"].values()]
        ok = (
            ok
            and bool(growths)
            and all(g is not None and g < args.max_rss_growth_pct for g in growths)
        )
    return 0 if ok else 1
