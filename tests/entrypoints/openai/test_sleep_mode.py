"""The sleep-mode routes (vLLM's /sleep, /wake_up, /is_sleeping): a sleeping server
answers generation with a 503 and, woken, gives the same tokens as before; without
--enable-sleep-mode the routes do not exist."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.entrypoints.openai.utils import RemoteServer

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def sleepy_server(tool_server: RemoteServer) -> RemoteServer:
    """The package's tool server, started with --enable-sleep-mode (each test here leaves
    it awake, for the modules that share it)."""
    return tool_server


def greedy_text(remote: RemoteServer) -> str:
    completion = remote.client().completions.create(
        model=remote.client().models.list().data[0].id,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
    )
    return completion.choices[0].text


def is_sleeping(remote: RemoteServer) -> bool:
    response = httpx.get(remote.url("/is_sleeping"), timeout=30)
    assert response.status_code == 200, response.text
    return bool(response.json()["is_sleeping"])


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_refuses_generation_and_wake_up_restores_it(
    sleepy_server: RemoteServer, level: int
) -> None:
    before = greedy_text(sleepy_server)
    assert not is_sleeping(sleepy_server)
    response = httpx.post(sleepy_server.url("/sleep"), params={"level": level}, timeout=60)
    assert response.status_code == 200, response.text
    assert is_sleeping(sleepy_server)
    with pytest.raises(openai.APIStatusError) as refused:
        greedy_text(sleepy_server)
    assert refused.value.status_code == 503
    assert "sleeping" in refused.value.message
    response = httpx.post(sleepy_server.url("/wake_up"), timeout=120)
    assert response.status_code == 200, response.text
    assert not is_sleeping(sleepy_server)
    assert greedy_text(sleepy_server) == before


def test_bad_sleep_arguments_are_400s_in_openais_shape(sleepy_server: RemoteServer) -> None:
    for path, params, param in [
        ("/sleep", {"level": 3}, "level"),
        ("/wake_up", {"tags": "activations"}, "tags"),
    ]:
        response = httpx.post(sleepy_server.url(path), params=params, timeout=30)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
    response = httpx.get(sleepy_server.url("/is_sleeping"), params={"model": "nope"}, timeout=30)
    assert response.status_code == 404
    assert not is_sleeping(sleepy_server)


def test_without_enable_sleep_mode_the_routes_are_404(server: RemoteServer) -> None:
    for method, path in [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")]:
        response = httpx.request(method, server.url(path), timeout=30)
        assert response.status_code == 404, (path, response.text)
