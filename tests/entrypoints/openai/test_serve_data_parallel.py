"""`kvserve serve -dp 2`: two engine cores behind one server, on the default model.
Greedy text as one core's (LLM), /metrics per core (engine="0", engine="1"),
and a core killed mid-generation: by default the server reports unhealthy and exits
non-zero within seconds; with --data-parallel-tolerate-failure the dead core's requests
get 503 and the other core keeps serving. Two "nodes": a front end running rank 0 and a
``--headless`` process running rank 1 that connects to it over TCP, same text, both
ranks serve (metrics and the dashboard's per-core rows); the headless node exits once
the front end is gone. External load balancing (--data-parallel-rank): one rank's core."""

from __future__ import annotations

import asyncio
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

from kvserve.sampling_params import SamplingParams
from kvserve.utils.processes import free_port
from tests.entrypoints.openai.utils import SERVER_ARGS, RemoteServer
from tests.family_models import build_family_model

LONG = 96  # tokens: long enough that a kill lands mid-generation
SHORT = 8
PROMPTS = [
    "The capital of France is",
    "Water boils at",
    "A haiku about the sea:",
    "def fibonacci(n):",
    "The three primary colors are",
    "Once upon a time, a fox",
]


def _start(*flags: str) -> RemoteServer:
    return RemoteServer("-dp", "2", *flags)


def _per_engine(server: RemoteServer, sample_name: str) -> dict[str, float]:
    text = httpx.get(server.url("/metrics"), timeout=10).text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample_name:
                totals[s.labels["engine"]] = totals.get(s.labels["engine"], 0) + s.value
    return totals


def _cores(server: RemoteServer) -> list[psutil.Process]:
    children = psutil.Process(server.proc.pid).children()
    cores = [c for c in children if "resource_tracker" not in " ".join(c.cmdline())]
    assert len(cores) == 2, [c.cmdline() for c in children]
    return cores


async def _complete(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> str | int:
    """The completion's text, or the HTTP status of its error."""
    try:
        completion = await client.completions.create(
            model=(await client.models.list()).data[0].id,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
    except openai.APIStatusError as exc:
        return exc.status_code
    return completion.choices[0].text


def _wait_running(server: RemoteServer, per_engine: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        running = _per_engine(server, "kvserve:num_requests_running")
        if len(running) == 2 and all(v >= per_engine for v in running.values()):
            return
        assert time.monotonic() < deadline, f"requests never started: {running}"
        time.sleep(0.05)


def test_tolerant_server_serves_on_after_a_core_dies(llm: Any) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=SHORT, ignore_eos=True)
    one_core = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    server = _start("--data-parallel-tolerate-failure")
    try:

        async def batch() -> list[str | int]:
            async with server.async_client(timeout=120) as client:
                return list(await asyncio.gather(*(_complete(client, p, SHORT) for p in PROMPTS)))

        assert asyncio.run(batch()) == one_core
        served = _per_engine(server, "kvserve:request_success_total")
        assert served.get("0", 0) > 0 and served.get("1", 0) > 0, served

        async def kill_mid_generation() -> list[str | int]:
            async with server.async_client(timeout=120) as client:
                tasks = [asyncio.create_task(_complete(client, PROMPTS[i], LONG)) for i in range(4)]
                await asyncio.to_thread(_wait_running, server, 2)
                _cores(server)[1].kill()
                return list(await asyncio.gather(*tasks))

        results = asyncio.run(kill_mid_generation())
        # The dead core's two requests are 503s; the live core's two complete.
        assert sorted(r if isinstance(r, int) else 200 for r in results) == [200, 200, 503, 503]
        assert httpx.get(server.url("/health"), timeout=5).status_code == 200

        assert asyncio.run(batch()) == one_core  # all on the live core now
        assert _per_engine(server, "kvserve:num_requests_running") == {"0": 0, "1": 0}
    finally:
        server.stop()


def test_by_default_a_dead_core_takes_the_server_down(tmp_path: Path) -> None:
    build_family_model("qwen3", tmp_path)  # tiny: this server only has to start and die
    server = _start(str(tmp_path), "--skip-tokenizer-init")
    try:
        _cores(server)[0].kill()
        killed_at = time.monotonic()
        server.wait_until_unhealthy()
        assert server.proc.wait(timeout=30) == 1
        assert time.monotonic() - killed_at < 10.0
        assert "data-parallel rank" in server.output()
    finally:
        server.stop()


def test_a_headless_node_serves_the_front_ends_other_rank(llm: Any) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=SHORT, ignore_eos=True)
    one_core = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    port = str(free_port())
    layout = ["-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-address"]
    layout += ["127.0.0.1", "--data-parallel-rpc-port", port]
    # The other node first: its core waits for the front end (ZMQ connects when it binds).
    log = tempfile.TemporaryFile("w+")
    node = ["--headless", "--data-parallel-start-rank", "1"]
    headless = subprocess.Popen(
        [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", *SERVER_ARGS, *layout, *node],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    server = None
    try:
        server = RemoteServer(*layout)  # healthy only once rank 1 has joined

        async def batch() -> list[str | int]:
            async with server.async_client(timeout=120) as client:
                return list(await asyncio.gather(*(_complete(client, p, SHORT) for p in PROMPTS)))

        assert asyncio.run(batch()) == one_core
        served = _per_engine(server, "kvserve:request_success_total")
        assert served.get("0", 0) > 0 and served.get("1", 0) > 0, served
        assert len(_cores_of(server)) == 1  # rank 1 is not the front end's child
        # The dashboard has a row per core, the remote one included.
        stats = httpx.get(server.url("/dashboard/stats"), timeout=10).json()
        assert [e["engine"] for e in stats["engines"]] == [0, 1], stats["engines"]
        assert server.stop() == 0
        # The front end closed its link: the headless node's core and launcher exit.
        assert headless.wait(timeout=60) == 0, _read(log)
    finally:
        if server is not None:
            server.stop()
        if headless.poll() is None:
            headless.kill()
            headless.wait()
        log.close()


def _read(log: Any) -> str:
    log.seek(0)
    return str(log.read())[-5000:]


def _cores_of(server: RemoteServer) -> list[psutil.Process]:
    children = psutil.Process(server.proc.pid).children()
    return [c for c in children if "resource_tracker" not in " ".join(c.cmdline())]


def test_external_load_balancing_runs_one_ranks_core(tmp_path: Path) -> None:
    """--data-parallel-rank: this server is rank 1 of 2 (the caller balances over the
    servers): one core, reporting as engine 1."""
    build_family_model("qwen3", tmp_path)
    server = RemoteServer(str(tmp_path), "--skip-tokenizer-init", "-dp", "2", "-dpn", "1")
    try:
        client = server.client()
        completion = client.completions.create(
            model=client.models.list().data[0].id, prompt=[5, 17, 42], max_tokens=3
        )
        assert completion.choices[0].finish_reason is not None
        assert _per_engine(server, "kvserve:request_success_total") == {"1": 1.0}
        assert len(_cores_of(server)) == 1
    finally:
        server.stop()
