"""A short soak against one real `kvserve serve`: two rounds of 32 misbehaving clients.

Streams, plain requests, disconnects, aborts and malformed requests mix for ~15 s per
round. Each round must end with no error of any kind (a 5xx, a refused good request, a
served bad one, a timeout), every KV block free, the server healthy and the same engine
core alive; RSS may not keep growing from the first round to the second.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from kvserve.benchmarks.soak import SoakConfig, require_loopback, run_soak
from tests.entrypoints.openai.utils import RemoteServer

pytestmark = pytest.mark.slow

# Short prompts and outputs: many requests (and drops) per client in a CPU-bound round.
ROUND = SoakConfig(
    clients=32, duration_s=15.0, max_tokens=8, max_prompt_words=12, request_timeout_s=90.0
)
# Per process, from the end of round 1 to the end of round 2: allocator noise, not a leak.
RSS_GROWTH_MIB = 64.0


@pytest.fixture(scope="module")
def soak_server() -> Iterator[RemoteServer]:
    remote = RemoteServer()
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
