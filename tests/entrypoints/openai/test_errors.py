"""Bad requests get a 4xx with OpenAI's error body, and the server keeps serving."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.entrypoints.openai.utils import MAX_MODEL_LEN, RemoteServer

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
HI = [{"role": "user", "content": "hi"}]
LONG_PROMPT = "hello " * (MAX_MODEL_LEN + 10)

# (endpoint, raw body or JSON, expected status, the param the error should name)
BAD_REQUESTS: list[tuple[str, Any, int, str | None]] = [
    ("/v1/chat/completions", b'{"messages": [', 400, None),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": HI, "temperature": [1]}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 1}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": HI, "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, None),
    ("/v1/completions", {"prompt": [10**9], "max_tokens": 1}, 400, None),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"not-a-token": 1}}, 400, None),
    ("/v1/nothing-here", {}, 404, None),
]


def _assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] == status
    return error


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
def test_bad_request_gets_openai_error_then_server_still_serves(
    server: RemoteServer, path: str, body: Any, status: int, param: str | None
) -> None:
    kwargs: dict[str, Any] = (
        {"content": body, "headers": {"Content-Type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    error = _assert_openai_error(httpx.post(server.url(path), timeout=60, **kwargs), status)
    if param is not None:
        assert error["param"] == param
    ok = httpx.post(
        server.url("/v1/chat/completions"), timeout=60, json={"messages": HI, "max_tokens": 1}
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None


def test_openai_client_raises_typed_errors(server: RemoteServer) -> None:
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=HI, max_tokens=1)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=MAX_MODEL_LEN)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=HI, stream=True, n=0)  # type: ignore[arg-type]
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=1).choices
