"""Real `kvserve serve` / `kvserve proxy` processes for the disaggregation tests: started
together, waited for together (model loads overlap), stopped by process group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from kvserve.utils.health import wait_until_healthy
from tests.entrypoints.openai.utils import SERVER_ARGS, _free_port

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
MODEL = "SmolLM2-135M-Instruct"
# Every instance requires this key and only the proxies send it: the tests reach the
# instances through keyed fronts, as an operator's fleet would be set up.
INSTANCE_KEY = "instance-key"


def p2p_producer() -> dict[str, Any]:
    return {"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer"}


def p2p_consumer(kv_port: int, policy: str = "recompute", timeout_s: float = 8.0) -> dict[str, Any]:
    return {
        "kv_connector": "P2pZmqConnector",
        "kv_role": "kv_consumer",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"kv_port": kv_port, "recv_timeout_s": timeout_s},
    }


class Process:
    """A kvserve sub-command in its own process group, its output in a temp file."""

    def __init__(
        self,
        name: str,
        args: list[str],
        port: int | None = None,
        key: str = "EMPTY",
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.key = key  # what its clients send (its --api-key, where it has one)
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"kvserve-{name}-", suffix=".log")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.entrypoints.cli", *args, "--port", str(self.port)],
            stdout=self.log, stderr=subprocess.STDOUT, env={**ENV, **(env or {})},
            start_new_session=True,
        )  # fmt: skip

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return str(self.log.read())[-5000:]

    def wait_healthy(self, timeout: float = 400.0) -> None:
        if wait_until_healthy(self.url, self.proc, time.monotonic() + timeout):
            return
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited during startup:\n{self.output()}")
        raise RuntimeError(f"{self.name} did not become healthy:\n{self.output()}")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.key, max_retries=0)

    def metrics(self) -> dict[tuple[str, str], float]:
        """(sample name, its kind/instance/stage label) -> value."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out: dict[tuple[str, str], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                label = s.labels.get("kind") or s.labels.get("instance") or s.labels.get("stage")
                out[(s.name, label or "")] = s.value
        return out

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def wait_stopped(self) -> None:
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.send_signal(sig)
        self.wait_stopped()


def stop_all(processes: list[Process]) -> None:
    """Each drains its shutdown alongside the others, not after them."""
    for process in processes:
        process.send_signal()
    for process in processes:
        process.wait_stopped()


def serve(name: str, transfer: dict[str, Any] | None, env: dict[str, str] | None = None) -> Process:
    args = ["serve", *SERVER_ARGS, "--api-key", INSTANCE_KEY]
    if transfer is not None:
        args += ["--kv-transfer-config", json.dumps(transfer)]
    return Process(name, args, key=INSTANCE_KEY, env=env)


def proxy(
    name: str,
    prefill: list[Process],
    decode: list[tuple[Process, int | None]],
    api_key: str | None = None,
) -> Process:
    args = ["proxy", "--backend-api-key", INSTANCE_KEY]
    for p in prefill:
        args += ["--prefill", p.url]
    for d, kv_port in decode:
        args += ["--decode", d.url if kv_port is None else f"{d.url}=127.0.0.1:{kv_port}"]
    if api_key is None:
        return Process(name, args)
    return Process(name, [*args, "--api-key", api_key], key=api_key)


def blocks_in_use(server: Process) -> float:
    # The gauge shows once the engine reported stats (after its first request).
    return server.metrics().get(("kvserve:kv_cache_blocks_in_use", ""), 0.0)


def wait_idle(server: Process, timeout: float = 30.0) -> None:
    """Until the server holds no KV block for any request (all freed, none leaked)."""
    deadline = time.monotonic() + timeout
    while (held := blocks_in_use(server)) != 0:
        assert time.monotonic() < deadline, f"{server.name} still holds {held} blocks"
        time.sleep(0.2)
