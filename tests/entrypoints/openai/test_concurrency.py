"""Many clients at once, and a client that leaves: the engine ends idle with its KV cache free."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.entrypoints.openai.utils import RemoteServer

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
NUM_CLIENTS = 64
MAX_TOKENS = 3


def test_64_concurrent_streams_complete_and_free_everything(server: RemoteServer) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, int]:
        # Short text prompts: this is about concurrency, not prefill work.
        stream = await client.completions.create(
            model=MODEL,
            prompt=f"{i} plus {i} is",
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, finish, tokens = "", None, 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return text, finish, tokens

    async def main() -> list[tuple[str, str | None, int]]:
        async with server.async_client(timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(NUM_CLIENTS)))

    results = asyncio.run(main())
    assert len(results) == NUM_CLIENTS
    for text, finish, tokens in results:
        assert text and finish == "length" and tokens == MAX_TOKENS
    server.wait_for_metrics(
        5.0, num_requests_running=0.0, num_requests_waiting=0.0, kv_cache_usage_perc=0.0
    )


def _generated(server: RemoteServer) -> float:
    return server.metrics()["kvserve:generation_tokens_total"]


# A client that leaves: its request is aborted, not run to its 400 tokens. Counted in
# tokens rather than timed, so a busy machine's slower steps change nothing.
def test_client_disconnect_aborts_the_request(server: RemoteServer) -> None:
    before = _generated(server)
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", server.url("/v1/completions"), json=body) as response:
            lines = response.iter_lines()
            received = [next(lines) for _ in range(4)]  # a few tokens: it is running
            assert all(not line or line.startswith("data: {") for line in received)
            metrics = server.metrics()
            assert metrics["kvserve:num_requests_running"] == 1.0
            assert metrics["kvserve:kv_cache_usage_perc"] > 0.0
        # Leaving the `with` closes the connection mid-stream.
    server.wait_for_metrics(30.0, num_requests_running=0.0, kv_cache_usage_perc=0.0)
    assert _generated(server) - before < 400


def test_non_streaming_disconnect_aborts_too(server: RemoteServer) -> None:
    before = _generated(server)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url("/v1/completions"), json=body, timeout=0.5)
    server.wait_for_metrics(30.0, num_requests_running=0.0, kv_cache_usage_perc=0.0)
    assert _generated(server) - before < 400
