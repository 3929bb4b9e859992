"""`kvserve serve -tp 2` end to end with the official openai client: a tiny random Llama
(4 query heads, 2 KV heads: one of each per rank) answers with transformers' greedy
tokens; then one worker process is killed and the server fails fast and exits non-zero."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from tests.entrypoints.openai.utils import RemoteServer
from tests.entrypoints.test_llm_tiny_models import CORPUS, build_model, hf_greedy

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("tp_serve_llama")
    return path, build_model("llama", path)


@pytest.fixture(scope="module", params=["mp", "ray"])
def server(request: pytest.FixtureRequest, tiny: tuple[Path, Any]) -> Iterator[RemoteServer]:
    if request.param == "ray":
        pytest.importorskip("ray", reason="the Ray executor needs `pip install ray` (extra: ray)")
    remote = RemoteServer(
        str(tiny[0]), "-tp", "2", "--kv-cache-memory", "8M",
        "--distributed-executor-backend", request.param,
    )  # fmt: skip
    remote.backend = request.param  # type: ignore[attr-defined]
    yield remote
    remote.stop()


def _workers(server: RemoteServer) -> list[psutil.Process]:
    core = server.engine_core_process()
    if server.backend == "ray":  # type: ignore[attr-defined]
        # Actors are the raylet's children, which the core started (a local Ray instance).
        actors = [
            c
            for c in core.children(recursive=True)
            if "ray::RayWorkerActor" in c.name() + " ".join(c.cmdline())
        ]
        return sorted(actors, key=lambda p: p.create_time())
    return [c for c in core.children() if "resource_tracker" not in " ".join(c.cmdline())]


def test_completions_match_transformers(server: RemoteServer, tiny: tuple[Path, Any]) -> None:
    path, reference = tiny
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    client = server.client()
    model = client.models.list().data[0].id
    assert len(_workers(server)) == 2
    for text in CORPUS[:3]:
        prompt = tokenizer.encode(text)
        response = client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        expected = tokenizer.decode(hf_greedy(reference, prompt, MAX_TOKENS))
        assert response.choices[0].text == expected
        assert response.usage is not None and response.usage.completion_tokens == MAX_TOKENS


def test_a_killed_worker_fails_the_server_fast(server: RemoteServer) -> None:
    model = server.client().models.list().data[0].id
    victim = _workers(server)[-1]
    victim.kill()
    killed_at = time.monotonic()
    # The core notices at once (it watches the workers, idle or not) and exits; the
    # server then answers requests with 5xx or closes, reports unhealthy, exits non-zero.
    try:
        server.client(timeout=30).completions.create(model=model, prompt="the quick", max_tokens=4)
        raise AssertionError("a request succeeded after a worker died")
    except openai.APIStatusError as e:
        assert e.status_code >= 500
    except (openai.APIConnectionError, httpx.HTTPError):
        pass
    server.wait_until_unhealthy()
    code = server.proc.wait(timeout=30)
    assert code not in (0, None)
    assert time.monotonic() - killed_at < 30
    assert "worker" in server.output() and "died" in server.output()
