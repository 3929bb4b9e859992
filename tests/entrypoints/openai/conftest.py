"""This package's fixtures: one shared server process and the model's tokenizer."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.entrypoints.openai.utils import RemoteServer


@pytest.fixture(scope="package")
def server() -> Iterator[RemoteServer]:
    # Package scope: the server (and its engine core) exits once the last test here ran,
    # rather than holding its memory through the rest of the suite.
    remote = RemoteServer()
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


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """The model's tokenizer, loaded here to count tokens independently of the server."""
    from kvserve.transformers_utils.model_resolver import resolve_model
    from kvserve.transformers_utils.tokenizer import get_tokenizer

    return get_tokenizer(resolve_model(None))
