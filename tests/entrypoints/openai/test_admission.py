"""Admission control and the bounds on engine resources, against one server with low limits.

16 running + 2 queued generations at most, 64 KiB bodies and a 20 s request timeout: beyond
them a request is refused or aborted, and every admitted one completes; nothing is left
holding KV blocks afterwards.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

from tests.entrypoints.openai.utils import RemoteServer

pytestmark = pytest.mark.slow

MAX_RUNNING, MAX_QUEUED = 16, 2
# Room for the burst test's 18 short requests on a machine the other test worker loads.
REQUEST_TIMEOUT_S = 20
BODY_LIMIT = 65536


@pytest.fixture(scope="module")
def limited() -> Iterator[RemoteServer]:
    remote = RemoteServer(
        "--max-num-seqs",
        str(MAX_RUNNING),
        "--max-queued-requests",
        str(MAX_QUEUED),
        "--retry-after",
        "2",
        "--max-request-body-size",
        str(BODY_LIMIT),
        "--request-timeout",
        str(REQUEST_TIMEOUT_S),
        # Room for generations longer than the timeout allows.
        "--max-model-len",
        "4096",
        "--kv-cache-memory",
        "256M",
    )
    yield remote
    remote.stop()


def _assert_idle(server: RemoteServer) -> None:
    # Aborted or finished, every request has given its blocks back.
    server.wait_for_metrics(30, num_requests_running=0, num_requests_waiting=0)
    assert server.metrics()["kvserve:kv_cache_usage_perc"] == 0


def test_a_burst_beyond_the_queue_bound_gets_503_with_retry_after(limited: RemoteServer) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True}

    async def stream(client: httpx.AsyncClient) -> list[str]:
        async with client.stream(
            "POST", limited.url("/v1/completions"), json={**body, "stream": True}
        ) as response:
            assert response.status_code == 200
            return [line async for line in response.aiter_lines() if line]

    async def main() -> tuple[list[list[str]], list[httpx.Response]]:
        async with httpx.AsyncClient(timeout=120) as client:
            admitted = [
                asyncio.create_task(stream(client)) for _ in range(MAX_RUNNING + MAX_QUEUED)
            ]
            # Until the engine holds them all: a full batch running, two waiting.
            await asyncio.to_thread(
                limited.wait_for_metrics,
                120,
                num_requests_running=MAX_RUNNING,
                num_requests_waiting=MAX_QUEUED,
            )
            burst = await asyncio.gather(
                *(client.post(limited.url("/v1/completions"), json=body) for _ in range(4))
            )
            return await asyncio.gather(*admitted), burst

    streams, burst = asyncio.run(main())
    for response in burst:
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"] == "2"
        assert response.json()["error"]["type"] == "ServiceUnavailableError"
    for events in streams:
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    _assert_idle(limited)
    # Capacity is back: the next request is admitted.
    response = httpx.post(limited.url("/v1/completions"), json=body, timeout=60)
    assert response.status_code == 200, response.text


def test_a_body_over_the_limit_is_a_413(limited: RemoteServer) -> None:
    body = {"prompt": "x" * BODY_LIMIT, "max_tokens": 1}
    response = httpx.post(limited.url("/v1/completions"), json=body, timeout=60)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == 413


def test_the_request_timeout_aborts_whole_and_streamed_requests(limited: RemoteServer) -> None:
    # Four sequences each, 8 decoding beside each other: 4,000 tokens take a sequence well
    # over the timeout on the fastest CPUs measured (~200 tok/s for one stream alone).
    body = {"prompt": "Once upon a time", "max_tokens": 4000, "n": 4, "ignore_eos": True}

    async def main() -> tuple[httpx.Response, list[str]]:
        async with httpx.AsyncClient(timeout=120) as client:

            async def streamed() -> list[str]:
                async with client.stream(
                    "POST", limited.url("/v1/completions"), json={**body, "stream": True}
                ) as response:
                    return [line async for line in response.aiter_lines() if line]

            return await asyncio.gather(
                client.post(limited.url("/v1/completions"), json=body), streamed()
            )

    whole, events = asyncio.run(main())
    assert whole.status_code == 408, whole.text
    assert whole.json()["error"]["type"] == "TimeoutError"
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == 408
    _assert_idle(limited)
