"""A client that opens a stream and never reads it holds no engine resources past its
generation: the engine finishes (or the stall guard aborts) the request and frees its
KV blocks while the client's socket is still open and unread."""

from __future__ import annotations

import json
import socket
import time

from tests.entrypoints.openai.utils import RemoteServer


def _post_and_never_read(server: RemoteServer, body: dict[str, object]) -> socket.socket:
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    # The smallest receive buffer the kernel allows, so the server's writes back up early.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


def test_a_reader_that_never_reads_frees_its_blocks(server: RemoteServer) -> None:
    body = {
        "prompt": "Write a long story about a lighthouse keeper.",
        "max_tokens": 96,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 5,
    }
    generated = "kvserve:generation_tokens_total"
    before = server.metrics().get(generated, 0.0)
    sockets = [_post_and_never_read(server, body) for _ in range(3)]
    try:
        deadline = time.monotonic() + 120
        while server.metrics().get(generated, 0.0) == before:
            assert time.monotonic() < deadline, "the unread streams never started generating"
            time.sleep(0.1)
        # While the sockets stay open and unread, the requests end and the pool is empty.
        server.wait_for_metrics(
            180, num_requests_running=0, num_requests_waiting=0, kv_cache_blocks_in_use=0
        )
        # The engine keeps serving others meanwhile.
        reply = server.client().completions.create(
            model=server.client().models.list().data[0].id,
            prompt="The capital of France is",
            max_tokens=4,
            temperature=0,
        )
        assert reply.choices[0].text
    finally:
        for sock in sockets:
            sock.close()
    server.wait_for_metrics(60, num_requests_running=0, kv_cache_blocks_in_use=0)
