"""Admission control and the bounds on engine resources, against one server with low limits.

2 running + 2 queued generations at most, 64 KiB bodies, a 30 s request timeout and a 1 s
stall bound on streams: beyond them a request is refused or aborted, and every admitted
one completes; nothing is left holding KV blocks afterwards.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator

import httpx
import pytest

from tests.entrypoints.openai.utils import RemoteServer

pytestmark = pytest.mark.slow

MAX_RUNNING, MAX_QUEUED = 2, 2
REQUEST_TIMEOUT_S = 30
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
        "--stream-stall-timeout",
        "1",
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
            # Until the engine holds them all: two running, two waiting.
            await asyncio.to_thread(
                limited.wait_for_metrics, 60, num_requests_running=2, num_requests_waiting=2
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
    body = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True}

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


def test_a_stream_nobody_reads_is_aborted_and_its_blocks_freed(limited: RemoteServer) -> None:
    # A client that sends its request and then never reads: a tiny receive window fills
    # within a few tokens (each chunk carries 20 logprobs), and the server's writes block.
    payload = json.dumps(
        {
            "prompt": "Once upon a time",
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
            "logprobs": 20,
        }
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", limited.port))
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        limited.wait_for_metrics(120, num_requests_running=1)
        # Long before 4000 tokens are generated. The request timeout cannot be what ends
        # it: only a stream that advances can notice its deadline; the stall bound does.
        limited.wait_for_metrics(300, num_requests_running=0)
    finally:
        sock.close()
    _assert_idle(limited)
    limited.log.flush()
    limited.log.seek(0)
    assert "stopped reading its stream" in limited.log.read()
