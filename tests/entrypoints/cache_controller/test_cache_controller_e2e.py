"""`kvserve cache-controller` over two real `kvserve serve` instances with a CPU KV tier.

The controller follows each instance's tier events and drives its tier through the
control service (CURVE sockets, MAC'd chunks: every process shares a KV secret): lookup names the instance and tier holding a served prompt; a pinned
prefix outlives eviction pressure that evicts an unpinned one; move copies a prefix into
the second instance's tier, which then serves the prompt from it (the same greedy text);
clear empties a tier; `kvserve router --controller` sends a prompt to the instance whose
CPU tier holds it. The device prefix cache is off, so every hit is the tier's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.utils.health import wait_until_healthy
from tests.entrypoints.openai.utils import SERVER_ARGS, _free_port

pytestmark = pytest.mark.slow

# The KV secret every process shares: the tier's event and control sockets are CURVE, and
# moved chunks carry its MAC (an instance with a control service refuses to start without).
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "KVSERVE_KV_SECRET": "cache-controller-test-secret",
}
MODEL = "SmolLM2-135M-Instruct"
KEY = "instance-key"
CHUNK = 32
# SmolLM2-135M: 30 layers x 2 x 32 tokens x 3 KV heads x 64 x 4 bytes = 1.4 MiB a chunk;
# the CPU tier holds 4 chunks: two prompts of two chunks each.
TIER_YAML = f"chunk_size: {CHUNK}\nlocal_cpu: true\nmax_local_cpu_size: 6MiB\n"


def _prompt(topic: str) -> str:
    """About 80 tokens: two full chunks and a tail."""
    return f"Notes on {topic}: " + " ".join(f"{topic} fact {i}." for i in range(14))


class Process:
    def __init__(self, args: list[str], url: str, name: str) -> None:
        self.url = url
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"kvserve-{name}-", suffix=".log")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.entrypoints.cli", *args],
            stdout=self.log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True,
        )  # fmt: skip

    def wait(self, timeout: float = 300) -> None:
        if not wait_until_healthy(self.url, self.proc, time.monotonic() + timeout):
            self.log.flush()
            self.log.seek(0)
            raise RuntimeError(f"{self.url} did not start:\n{self.log.read()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        self.log.close()


class Instance(Process):
    def __init__(self, workdir: Path, name: str) -> None:
        port, self.events_port, self.control_port = _free_port(), _free_port(), _free_port()
        config = workdir / f"{name}.yaml"
        config.write_text(
            TIER_YAML
            + f"tier_events_endpoint: tcp://127.0.0.1:{self.events_port}\n"
            + f"control_endpoint: tcp://127.0.0.1:{self.control_port}\n"
        )
        super().__init__(
            ["serve", "--port", str(port), *SERVER_ARGS, "--kv-cache-config", str(config),
             "--no-enable-prefix-caching", "--api-key", KEY],
            f"http://127.0.0.1:{port}", name,
        )  # fmt: skip

    def registration(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "control": f"tcp://127.0.0.1:{self.control_port}",
            "tier_events": f"tcp://127.0.0.1:{self.events_port}",
        }

    def complete(self, prompt: str) -> str:
        answer = httpx.post(
            f"{self.url}/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0},
            headers={"authorization": f"Bearer {KEY}"},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        return str(answer.json()["choices"][0]["text"])

    def tokens(self, prompt: str) -> list[int]:
        answer = httpx.post(
            f"{self.url}/tokenize",
            json={"prompt": prompt},
            headers={"authorization": f"Bearer {KEY}"},
            timeout=30,
        )
        return list(answer.json()["tokens"])

    def tier_hits(self) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "kvserve:kv_connector_tier_hits_total" and s.labels.get("kind") == "cpu"
        )


class Controller(Process):
    def __init__(self) -> None:
        port = _free_port()
        super().__init__(
            ["cache-controller", "--port", str(port), "--backend-api-key", KEY],
            f"http://127.0.0.1:{port}", "controller",
        )  # fmt: skip

    def post(self, path: str, body: dict[str, Any], status: int = 200) -> Any:
        answer = httpx.post(f"{self.url}{path}", json=body, timeout=60)
        assert answer.status_code == status, answer.text
        return answer.json()

    def lookup(self, tokens: list[int]) -> dict[str, dict[str, int]]:
        return dict(self.post("/lookup", {"tokens": tokens})["instances"])

    def wait_for(
        self, tokens: list[int], done: Callable[[dict[str, dict[str, int]]], bool]
    ) -> dict[str, dict[str, int]]:
        """The lookup once ``done`` holds for it (the tier events take a moment)."""
        deadline = time.monotonic() + 20
        while not done(found := self.lookup(tokens)):
            assert time.monotonic() < deadline, f"lookup never settled: {found}"
            time.sleep(0.1)
        return found


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Controller, Instance, Instance]]:
    workdir = tmp_path_factory.mktemp("controller")
    a, b = Instance(workdir, "a"), Instance(workdir, "b")
    controller = Controller()
    try:
        for process in (controller, a, b):
            process.wait()
        for instance in (a, b):
            info = controller.post("/register", instance.registration())
            assert info["chunk_size"] == CHUNK and info["tiers"] == ["cpu"]
        yield controller, a, b
    finally:
        for process in (controller, a, b):
            process.stop()


def test_lookup_pin_move_clear(fleet: tuple[Controller, Instance, Instance]) -> None:
    controller, a, b = fleet
    prompt = _prompt("tides")
    tokens = a.tokens(prompt)
    assert 2 * CHUNK < len(tokens) < 3 * CHUNK
    text_a = a.complete(prompt)
    found = controller.wait_for(tokens, lambda f: f[a.url].get("cpu") == 2 * CHUNK)
    assert found == {a.url: {"cpu": 2 * CHUNK}, b.url: {}}
    by_text = controller.post("/lookup", {"text": prompt})
    assert by_text["num_tokens"] == len(tokens) and by_text["instances"] == found

    # Pinned: two more prompts (four chunks) through a four-chunk tier: the second evicts
    # the first's chunks, never the pinned ones.
    pinned = controller.post("/pin", {"instance": a.url, "tier": "cpu", "tokens": tokens})
    assert pinned["num_tokens"] == 2 * CHUNK
    other = a.tokens(_prompt("glaciers"))
    a.complete(_prompt("glaciers"))
    controller.wait_for(other, lambda f: f[a.url].get("cpu") == 2 * CHUNK)
    a.complete(_prompt("volcanoes"))
    controller.wait_for(other, lambda f: not f[a.url])
    assert controller.lookup(tokens)[a.url] == {"cpu": 2 * CHUNK}
    unpinned = controller.post("/unpin", {"instance": a.url, "tier": "cpu", "tokens": tokens})
    assert unpinned["num_tokens"] == 2 * CHUNK

    # Move into b's CPU tier: b now serves the prompt from it, with a's greedy text.
    moved = controller.post("/move", {"source": a.url, "target": b.url, "tokens": tokens})
    assert moved == {"num_tokens": 2 * CHUNK, "num_chunks": 2, "rejected": 0}
    controller.wait_for(tokens, lambda f: f[b.url] == {"cpu": 2 * CHUNK})
    # Registered afresh, b is known at once from its tier's inventory, not from events.
    controller.post("/register", b.registration())
    assert controller.lookup(tokens)[b.url] == {"cpu": 2 * CHUNK}
    hits = b.tier_hits()
    assert b.complete(prompt) == text_a
    assert b.tier_hits() > hits

    controller.post("/clear", {"instance": a.url, "tier": "cpu"})
    found = controller.wait_for(tokens, lambda f: not f[a.url])
    assert found[b.url] == {"cpu": 2 * CHUNK}
    instances = {i["name"]: i for i in httpx.get(f"{controller.url}/instances").json()}
    assert instances[a.url]["held"] == {} and instances[b.url]["held"]["cpu"] >= 2


def test_router_routes_to_the_cpu_tier_holding_the_prompt(
    fleet: tuple[Controller, Instance, Instance],
) -> None:
    controller, a, b = fleet
    # b's tier holds "tides" (moved there above); a's holds "comets" only.
    controller.post("/clear", {"instance": b.url, "tier": "cpu"})
    controller.post("/move", {"source": b.url, "target": b.url, "source_tier": "cpu",
                              "target_tier": "cpu", "text": "x"}, status=400)  # fmt: skip
    held_b, held_a = _prompt("tides"), _prompt("comets")
    b.complete(held_b)
    a.complete(held_a)
    controller.wait_for(a.tokens(held_b), lambda f: f[b.url] == {"cpu": 2 * CHUNK})
    controller.wait_for(a.tokens(held_a), lambda f: f[a.url] == {"cpu": 2 * CHUNK})
    port = _free_port()
    router = Process(
        ["router", "--port", str(port), "--controller", controller.url, "--backend", a.url,
         "--backend", b.url, "--backend-api-key", KEY],
        f"http://127.0.0.1:{port}", "router",
    )  # fmt: skip
    try:
        router.wait()
        for prompt, holder in [(held_b, b), (held_a, a), (held_b + " More.", b)]:
            answer = httpx.post(
                f"{router.url}/v1/completions",
                json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0},
                timeout=120,
            )
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-kvserve-backend"] == holder.url, prompt[:20]
    finally:
        router.stop()


def test_errors_health_and_schema(fleet: tuple[Controller, Instance, Instance]) -> None:
    controller, a, b = fleet
    bad_tier = controller.post("/pin", {"instance": a.url, "tier": "gpu", "tokens": [1]}, 400)
    assert "tier" in bad_tier["error"]["message"]
    bad_endpoint = controller.post("/register", {"url": a.url, "control": "tcp://h"}, 400)
    assert "control" in bad_endpoint["error"]["message"]
    neither = controller.post("/lookup", {}, 400)
    assert "tokens" in neither["error"]["message"]
    unknown = controller.post("/clear", {"instance": "http://nowhere:1", "tier": "cpu"}, 404)
    assert "instance" in unknown["error"]["message"]
    no_disk = controller.post("/clear", {"instance": a.url, "tier": "disk"}, 400)
    assert "disk" in no_disk["error"]["message"]
    health = httpx.get(f"{controller.url}/health", timeout=30).json()
    assert health == {"healthy": True, "instances": {a.url: True, b.url: True}}
    # Gone from the index and the answers once deregistered; back with its tier listed.
    controller.post("/deregister", {"url": b.url})
    assert b.url not in controller.post("/lookup", {"tokens": [1, 2, 3]})["instances"]
    controller.post("/deregister", {"url": b.url}, 404)
    controller.post("/register", b.registration())
    schema = httpx.get(f"{controller.url}/openapi.json", timeout=10).json()
    for path in ("/register", "/deregister", "/lookup", "/pin", "/unpin", "/clear", "/move",
                 "/health", "/instances"):  # fmt: skip
        assert path in schema["paths"], path
    assert json.dumps(schema["components"]["schemas"]["MoveRequest"])
