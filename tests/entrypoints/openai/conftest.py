"""This package's fixtures: the shared server processes and the model's tokenizer.

`server` is the default one. `tool_server` carries flags that several modules need
(utils.py says which and why); it is stopped after the last test that uses it, not at the
end of the package, so that only the servers still needed hold memory."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.entrypoints.openai.utils import TOOL_SERVER_ARGS, RemoteServer

# vLLM command-line flags a `vllm serve` line carries: accepted, the no-ops logged
# (test_serving_responses). Each is a no-op or kvserve's default, so every module's tests
# run on this server as on a bare one.
VLLM_FLAGS = (
    "--enforce-eager",
    "--swap-space",
    "4",
    "--trust-remote-code",
    "--max-logprobs",
    "20",
    "--generation-config",
    "auto",
    "--disable-frontend-multiprocessing",
    "--tensor-parallel-size",
    "1",
)


@pytest.fixture(scope="package")
def server() -> Iterator[RemoteServer]:
    # Package scope: the server (and its engine core) exits once the last test here ran,
    # rather than holding its memory through the rest of the suite.
    remote = RemoteServer(*VLLM_FLAGS, forced_tokens=True)
    yield remote
    # The shutdown contract, checked on the way out: SIGTERM stops admitting, lets an
    # in-flight request finish, then the server exits 0.
    body = {
        "prompt": "Once upon a time",
        "max_tokens": 32,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", remote.url("/v1/completions"), json=body) as response,
    ):
        lines = response.iter_lines()
        assert next(lines).startswith("data: {")
        remote.proc.send_signal(signal.SIGTERM)
        _assert_not_admitted(remote, body)
        rest = list(lines)
    code = remote.stop()
    events = [line for line in rest if line]
    assert events[-1] == "data: [DONE]", events
    usage = json.loads(events[-2].removeprefix("data: "))["usage"]
    assert usage["completion_tokens"] == 32, "the in-flight request was cut short"
    assert code == 0, "the server did not exit cleanly after SIGTERM"


def _assert_not_admitted(remote: RemoteServer, body: dict[str, Any]) -> None:
    """A request sent while the server drains is refused: its listener is closed, or the
    admission middleware answers 503 with Retry-After."""
    try:
        late = httpx.post(remote.url("/v1/completions"), json=body, timeout=30)
    except httpx.TransportError:
        return  # the listening socket is closed: nothing new gets in
    assert late.status_code == 503, late.text
    assert late.headers["retry-after"]


# Fixture name -> (its server, the node ids of the collected tests that use it and have
# not run yet here). The server stops once all have run: not at the last one in collection
# order, which a pytest-xdist worker may run before the others (they then met a stopped
# server). Where another worker runs some of them, or only getfixturevalue asks for it,
# the set never empties and the server stops at the package's end.
_SHARED: dict[str, tuple[RemoteServer, set[str]]] = {}
_NO_TEST = ""  # no test's node id: a set holding it never empties


def _shared_server(
    request: pytest.FixtureRequest, *args: str, forced_tokens: bool = False
) -> Iterator[RemoteServer]:
    name = request.fixturename
    users = {item.nodeid for item in request.session.items if name in item.fixturenames}
    remote = RemoteServer(*args, forced_tokens=forced_tokens)
    _SHARED[name] = (remote, users or {_NO_TEST})
    yield remote
    _SHARED.pop(name, None)
    remote.stop()  # a no-op where pytest_runtest_teardown stopped it already


@pytest.fixture(scope="package")
def tool_server(request: pytest.FixtureRequest) -> Iterator[RemoteServer]:
    yield from _shared_server(request, *TOOL_SERVER_ARGS, forced_tokens=True)


def pytest_runtest_teardown(item: pytest.Item) -> None:
    for name, (remote, waiting) in list(_SHARED.items()):
        waiting.discard(item.nodeid)
        if not waiting:
            del _SHARED[name]
            remote.stop()


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """The model's tokenizer, loaded here to count tokens independently of the server."""
    from kvserve.transformers_utils.model_resolver import resolve_model
    from kvserve.transformers_utils.tokenizer import get_tokenizer

    return get_tokenizer(resolve_model(None))
