"""A server started with --api-key: auth on /v1/*, then its engine core is killed.

The kill test comes last in this module: it ends this module's server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.entrypoints.openai.utils import RemoteServer

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KEY = "test-key-123"


@pytest.fixture(scope="module")
def keyed_server() -> Iterator[RemoteServer]:
    remote = RemoteServer("--api-key", KEY, "--allowed-origins", '["http://example.test"]')
    yield remote
    remote.stop()


def test_missing_or_wrong_key_is_401_and_right_key_works(keyed_server: RemoteServer) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = httpx.post(keyed_server.url("/v1/completions"), json=body, headers=headers)
        assert response.status_code == 401
        error = response.json()["error"]
        assert error["type"] == "AuthenticationError" and error["code"] == 401
    with pytest.raises(openai.AuthenticationError):
        keyed_server.client(api_key="wrong").models.list()
    out = keyed_server.client(api_key=KEY).completions.create(
        model=MODEL, prompt="hi", max_tokens=1
    )
    assert out.choices
    # Every route with data is guarded, the tokenizer's too; probes, the schema and (without
    # --metrics-auth) the scraper's /metrics need no key.
    for path, payload in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        assert httpx.post(keyed_server.url(path), json=payload).status_code == 401
        headers = {"Authorization": f"Bearer {KEY}"}
        assert httpx.post(keyed_server.url(path), json=payload, headers=headers).status_code == 200
    assert httpx.get(keyed_server.url("/health")).status_code == 200
    assert httpx.get(keyed_server.url("/openapi.json")).status_code == 200
    assert httpx.get(keyed_server.url("/metrics")).status_code == 200


def test_cors_preflight_allows_the_configured_origin(keyed_server: RemoteServer) -> None:
    response = httpx.options(
        keyed_server.url("/v1/completions"),
        headers={"Origin": "http://example.test", "Access-Control-Request-Method": "POST"},
    )
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "http://example.test"


def test_killing_the_engine_core_fails_requests_and_health_promptly(
    keyed_server: RemoteServer,
) -> None:
    async def long_stream(client: openai.AsyncOpenAI) -> BaseException | None:
        try:
            stream = await client.completions.create(
                model=MODEL,
                prompt="Once upon a time",
                max_tokens=400,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for _ in stream:
                pass
        except (openai.APIError, httpx.HTTPError) as exc:
            return exc
        return None

    async def main() -> tuple[list[BaseException | None], float]:
        async with keyed_server.async_client(api_key=KEY, timeout=60) as client:
            tasks = [asyncio.create_task(long_stream(client)) for _ in range(2)]
            # Wait until both are generating, then kill the core under them.
            deadline = time.monotonic() + 60
            while keyed_server.metrics().get("kvserve:num_requests_running", 0) < 2:
                assert time.monotonic() < deadline, "requests never started"
                await asyncio.sleep(0.1)
            keyed_server.engine_core_process().kill()
            killed_at = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
            return results, time.monotonic() - killed_at

    results, elapsed = asyncio.run(main())
    assert all(r is not None for r in results), "in-flight requests must end with an error"
    assert elapsed < 5.0
    # /health answers 503 while the server winds down, then the server is gone.
    keyed_server.wait_until_unhealthy()
    assert keyed_server.proc.wait(timeout=30) == 1
