"""`kvserve bench soak`: many misbehaving clients against one loopback server, for a set time.

N concurrent clients (soak_clients.py) stream and post requests of random lengths, drop
streams, abort requests and send malformed ones until the duration or the request cap
runs out. Then it reports requests served, errors by kind, p50/p99 latency, the peak
RSS of the server and its engine-core child, the KV blocks still in use (from
kvserve:kv_cache_blocks_in_use, after a final probe request; 0 unless blocks leaked)
and whether the server is still healthy (/health, the probe, the same engine core).
It starts its own `kvserve serve` on 127.0.0.1, or soaks a loopback --url.
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
from kvserve.benchmarks.soak_monitor import RssSampler
from kvserve.benchmarks.step_times import scrape_step_times
from kvserve.utils.health import wait_until_healthy
from kvserve.utils.processes import free_port

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}
MAX_DURATION_S = 4 * 3600.0


@dataclass
class SoakConfig:
    clients: int = 64
    duration_s: float = 60.0
    max_requests: int = 100_000
    max_tokens: int = 24
    max_prompt_words: int = 48
    request_timeout_s: float = 120.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.clients <= 1024:
            raise ValueError(f"clients must be in [1, 1024], got {self.clients}")
        if not 0 < self.duration_s <= MAX_DURATION_S:
            raise ValueError(f"duration_s must be in (0, {MAX_DURATION_S}], got {self.duration_s}")
        if self.max_requests < 1 or self.max_tokens < 1 or self.max_prompt_words < 1:
            raise ValueError("max_requests, max_tokens and max_prompt_words must be positive")


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


async def run_soak(base_url: str, config: SoakConfig, server_pid: int | None = None) -> dict:
    """One soak round against a running loopback server; returns the report."""
    require_loopback(base_url)
    limits = httpx.Limits(max_connections=config.clients + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=config.request_timeout_s, limits=limits
    ) as client:
        model = (await client.get("/v1/models", timeout=10)).json()["data"][0]["id"]
        sampler = RssSampler(server_pid) if server_pid is not None else None
        sampling = asyncio.create_task(sampler.run()) if sampler else None
        tally = SoakTally()
        busy_before = await scrape_step_times(client, base_url)
        before = await scrape(client)
        start = time.monotonic()
        plan = ClientPlan(
            model=model,
            deadline=start + config.duration_s,
            max_requests=config.max_requests,
            max_tokens=config.max_tokens,
            max_prompt_words=config.max_prompt_words,
            request_timeout_s=config.request_timeout_s,
        )
        rng = random.Random(config.seed)
        await asyncio.gather(
            *(
                run_client(client, plan, tally, random.Random(rng.getrandbits(64)))
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
    healthy = checks["probe_status"] == 200 and checks["health_status"] == 200
    if sampler is not None:
        healthy = healthy and not sampler.lost
    return {
        "clients": config.clients,
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
        "lost_processes": sampler.lost if sampler else None,
        **checks,
        "healthy": healthy,
    }


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
        "--url", default=None, help="soak a running loopback server instead of starting one"
    )
    parser.add_argument("--server-pid", type=int, default=None, help="its pid, for RSS (--url)")
    parser.add_argument(
        "--server-args",
        default="--max-num-seqs 64 --disable-log-requests --uvicorn-log-level warning",
        help="flags for the `kvserve serve` the soak starts (one string)",
    )
    parser.add_argument("--server-log", default=None, help="default: a file under /tmp")
    parser.add_argument("--output-json", default=None)


def main(args: argparse.Namespace) -> int:
    config = SoakConfig(
        clients=args.clients,
        duration_s=args.duration,
        max_requests=args.max_requests,
        max_tokens=args.max_tokens,
        max_prompt_words=args.max_prompt_words,
        request_timeout_s=args.request_timeout,
        seed=args.seed,
    )
    proc = None
    if args.url is None:
        log_path = args.server_log or tempfile.mkstemp(prefix="kvserve-soak-", suffix=".log")[1]
        print(f"server log: {log_path}", file=sys.stderr)
        proc, base_url = start_server(shlex.split(args.server_args), log_path)
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
    text = json.dumps(report, indent=2)
    print(text)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(text + "\n")
    ok = report["healthy"] and not report["errors"] and report["kv_blocks_in_use"] == 0
    return 0 if ok else 1
