"""A served engine with the tiered KV cache exports its tier metrics in /metrics."""

from __future__ import annotations

import ipaddress
import time
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.openai.utils import RemoteServer

pytestmark = pytest.mark.slow


def tier_hits(server: RemoteServer) -> dict[str, float]:
    text = httpx.get(server.url("/metrics"), timeout=10).text
    return {
        sample.labels["kind"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvserve:kv_connector_tier_hits_total"
    }


def listeners(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket listening in ``pid`` and its descendants: what a
    port scan from the machine itself finds."""
    root = psutil.Process(pid)
    return [
        (conn.laddr.ip, conn.laddr.port)
        for proc in [root, *root.children(recursive=True)]
        for conn in proc.net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN
    ]


def test_tier_hits_reach_prometheus(tmp_path: Path) -> None:
    config = tmp_path / "tiers.yaml"
    config.write_text("chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 64MiB\n")
    # Without the engine's own prefix cache the repeated prompt must come from the tier.
    # KV events on at their default address: with the tier, every socket a default
    # server opens, none of which may listen beyond this machine.
    server = RemoteServer(
        "--kv-cache-config",
        str(config),
        "--no-enable-prefix-caching",
        "--kv-events-config",
        '{"enable_kv_cache_events": true}',
    )
    try:
        found = listeners(server.proc.pid)
        assert {server.port, 5557} <= {port for _, port in found}  # HTTP and the events
        assert all(ipaddress.ip_address(ip).is_loopback for ip, _ in found), found
        client = server.client()
        prompt = "Count with me: " + " ".join(str(i) for i in range(100, 175))
        ids = httpx.post(server.url("/tokenize"), json={"prompt": prompt}).json()["tokens"]
        assert 256 < len(ids) < 480
        texts = [
            client.completions.create(
                model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=8, temperature=0
            )
            .choices[0]
            .text
            for _ in range(2)
        ]
        assert texts[0] == texts[1]
        deadline = time.monotonic() + 10
        while tier_hits(server).get("cpu", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert tier_hits(server).get("cpu", 0) >= 1
    finally:
        assert server.stop() == 0
