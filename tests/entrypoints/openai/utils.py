"""RemoteServer: a real `kvserve serve` process (engine core included) for the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
from prometheus_client.parser import text_string_to_metric_families

import kvserve
from tests.forced_tokens import FORCED_TOKENS

# Small enough to start fast and to make "beyond the context" cheap to provoke.
MAX_MODEL_LEN = 512
SERVER_ARGS = [
    "--kv-cache-memory",
    "96M",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--max-num-seqs",
    "64",
    "--uvicorn-log-level",
    "warning",
    "--disable-log-requests",
]

# Off unless a request asks (vllm_xargs): makes the model emit a given output, so the
# parsers and agent loops are tested on what a real model's output looks like. Only the
# servers of tests that force tokens load it (RemoteServer(forced_tokens=True)): its
# module imports torch, which an API server's process otherwise never does, ~1.4 s of CPU
# a start. Given first: it takes a list, which would swallow a model path given after it.
FORCED_TOKENS_ARGS = ("--logits-processors", FORCED_TOKENS)

# The servers conftest.py shares between modules besides the default one: each start is a
# server and an engine core (seconds of a 2-core CI machine), so modules whose flags do not
# change each other's tests run on one server started with the union of their flags.
TOOL_TEMPLATE = (
    Path(kvserve.__file__).parent / "entrypoints/chat_templates/tool_chat_template_hermes.jinja"
)
# Tool calling with a template that renders tool messages (test_structured_outputs,
# test_responses_tools), vLLM's metric names (test_responses_tools: the other modules read
# no metrics here), sleep mode (test_sleep_mode: every sleep there ends in a wake-up) and
# stored responses (test_serving_responses; test_responses_tools reads no `store` field).
# Its first user runs in test_responses_tools and its last in test_structured_outputs:
# one more server's memory while the dozen modules between those run.
TOOL_SERVER_ARGS = (
    "--chat-template",
    str(TOOL_TEMPLATE),
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--metrics-prefix",
    "vllm",
    "--enable-sleep-mode",
    "--enable-store-responses",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RemoteServer:
    """Starts the server as a subprocess and waits for /health; stop() sends SIGTERM."""

    def __init__(
        self, *extra_args: str, forced_tokens: bool = False, startup_timeout: float = 240.0
    ) -> None:
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvserve-server-", suffix=".log")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvserve.entrypoints.cli",
                "serve",
                "--port",
                str(self.port),
                *(FORCED_TOKENS_ARGS if forced_tokens else ()),
                *SERVER_ARGS,
                *extra_args,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
        )
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited during startup:\n{self.output()}")
            try:
                if httpx.get(self.url("/health"), timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server did not become healthy:\n{self.output()}")

    def url(self, path: str) -> str:
        return self.base_url + path

    def output(self, tail: int | None = 5000) -> str:
        """The server's log: its last ``tail`` characters, or all of it (None)."""
        self.log.flush()
        self.log.seek(0)
        text = self.log.read()
        return text if tail is None else text[-tail:]

    def client(self, api_key: str = "EMPTY", **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url("/v1"), api_key=api_key, max_retries=0, **kwargs)

    def async_client(self, api_key: str = "EMPTY", **kwargs: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.url("/v1"), api_key=api_key, max_retries=0, **kwargs
        )

    def metrics(self) -> dict[str, float]:
        """Sample name -> value (labels dropped: one model, one engine)."""
        text = httpx.get(self.url("/metrics"), timeout=10).text
        return {
            s.name: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def wait_for_metrics(self, timeout: float, **expected: float) -> float:
        """Seconds until every `kvserve:<name>` equals its expected value; fails on timeout."""
        start = time.monotonic()
        while True:
            values = self.metrics()
            got = {k: values.get(f"kvserve:{k}") for k in expected}
            if got == expected:
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise AssertionError(f"metrics {got} != {expected} after {timeout} s")
            time.sleep(0.05)

    def wait_until_unhealthy(self, timeout: float = 10.0) -> None:
        """After its engine died: /health answers 200 until the front end has seen the
        death (a thread or a poll wakes for it: on a loaded machine, some milliseconds,
        and a request may fail first), then 503 until the server is gone."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                status = httpx.get(self.url("/health"), timeout=5).status_code
            except httpx.ConnectError:
                return
            if status != 200:
                assert status == 503, status
                return
            assert time.monotonic() < deadline, "/health still 200 after the engine died"
            time.sleep(0.05)

    def engine_core_process(self) -> psutil.Process:
        # The core is a spawned child; the other possible child is multiprocessing's
        # resource tracker, whose command line says so.
        children = psutil.Process(self.proc.pid).children()
        cores = [c for c in children if "resource_tracker" not in " ".join(c.cmdline())]
        assert len(cores) == 1, [c.cmdline() for c in children]
        return cores[0]

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
