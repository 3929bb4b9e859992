"""`kvserve router`: one OpenAI-compatible front door over several kvserve instances,
sending each request to the instance that already caches the longest prefix of it.

For each completion or chat request the router asks an instance's ``/tokenize`` for the
prompt's token ids (chat requests are rendered by the same template the instances use),
hashes them as the engines do, and picks from the PrefixIndex the healthy instance with
the longest cached prefix, the least loaded among equals (requests in flight through the
router). The request is then forwarded unchanged and the answer streamed back; a client
that disconnects aborts the upstream request. ``--policy round_robin`` ignores the index
(the baseline the prefix policy is measured against).

An instance that fails a request at the connection level (refused, reset) or fails its
/health leaves the rotation; the health loop brings it back when it answers, and its KV
events (replayed or fresh) fill the index again.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from kvserve.core.prefix_index import PrefixIndex
from kvserve.entrypoints.front_door import (
    UpstreamKeys,
    add_front_door_auth_args,
    build_front_door_app,
    front_door_keys,
    json_object_body,
    openai_error,
)
from kvserve.entrypoints.openai.tenants import current_tenant, tenant_salt
from kvserve.entrypoints.router.backends import Backend, EventFollowers
from kvserve.entrypoints.router.controller_lookup import ControllerLookup
from kvserve.utils.kv_secret import add_kv_secret_arg, read_kv_secret
from kvserve.utils.zmq_curve import PLAIN_SOCKETS, SocketSecurity, socket_security

logger = logging.getLogger(__name__)

POLICIES = ("prefix", "round_robin")
HEALTH_INTERVAL_S = 1.0


class Router:
    def __init__(
        self,
        backends: list[Backend],
        block_size: int,
        hash_seed: int,
        policy: str,
        upstream_keys: UpstreamKeys | None = None,
        security: SocketSecurity = PLAIN_SOCKETS,
        controller: ControllerLookup | None = None,
    ) -> None:
        if not backends:
            raise ValueError("the router needs at least one --backend")
        if policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.backends = backends
        self.policy = policy
        self.index = PrefixIndex(block_size, hash_seed)
        self.lock = threading.Lock()
        self.followers = EventFollowers(backends, self.index, self.lock, security)
        self._rotation = itertools.count()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        self.prefix_tokens_matched = 0
        self.keys = upstream_keys or UpstreamKeys()
        # Where the cached prefixes come from: the instances' events followed here, or a
        # cache controller's lookup (every tier: device, cpu, disk, remote).
        self.controller = controller

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    def mark_down(self, backend: Backend, why: str) -> None:
        if backend.healthy:
            logger.warning("%s left the rotation: %s", backend.url, why)
        backend.healthy = False
        self.followers.reset(backend)

    async def tokenize(self, path: str, body: dict[str, Any], request: Request) -> list[int] | None:
        """The prompt's token ids from an instance, or None where the prompt is not one
        text or message list (token-id prompts pass through as they are)."""
        if path.endswith("/chat/completions"):
            payload: dict[str, Any] = {"messages": body.get("messages")}
            for key in ("add_generation_prompt", "continue_final_message", "chat_template"):
                if key in body:
                    payload[key] = body[key]
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return prompt
            if not isinstance(prompt, str):
                return None
            payload = {"prompt": prompt}
        for backend in sorted(self.healthy(), key=lambda b: b.in_flight):
            try:
                answer = await self.client.post(
                    f"{backend.url}/tokenize",
                    json=payload,
                    headers=self.keys.headers(backend.url, request),
                )
            except httpx.TransportError as exc:
                self.mark_down(backend, repr(exc))
                continue
            if answer.status_code != 200:
                return None  # the instance that serves it will give the client its error
            return list(answer.json()["tokens"])
        return None

    async def matched(self, token_ids: list[int] | None, cache_salt: str | None) -> dict[str, int]:
        """Cached prefix tokens per instance (empty when the policy does not look)."""
        if self.policy == "round_robin" or token_ids is None:
            return {}
        if self.controller is not None:
            return await self.controller.match(self.client, token_ids, cache_salt)
        with self.lock:  # the prompt is hashed once, for the choice and the metric
            return self.index.match(token_ids, cache_salt)

    def choose(self, token_ids: list[int] | None, matched: Mapping[str, int]) -> Backend | None:
        healthy = self.healthy()
        if not healthy:
            return None
        if self.policy == "round_robin" or token_ids is None:
            return healthy[next(self._rotation) % len(healthy)]
        # Equal prefixes: the least busy, then the least used (new conversations spread).
        loads = {b.url: (b.in_flight, b.routed) for b in healthy}
        url = self.index.pick(matched, loads)
        self.prefix_tokens_matched += matched.get(url, 0)
        return next(b for b in healthy if b.url == url)

    async def forward(self, request: Request, path: str) -> Response:
        body = await json_object_body(request)
        if isinstance(body, Response):
            return body
        tokens = await self.tokenize(path, body, request) if self.policy == "prefix" else None
        salt = tenant_salt(current_tenant.get(), body.get("cache_salt"))
        matched = await self.matched(tokens, salt)
        # An instance that cannot be reached has not seen the request: try the next.
        while (backend := self.choose(tokens, matched)) is not None:
            backend.in_flight += 1  # from now: a non-streamed answer's headers come last
            try:
                upstream = await self.client.send(
                    self.client.build_request(
                        "POST",
                        f"{backend.url}{path}",
                        json=body,
                        headers=self.keys.headers(backend.url, request),
                    ),
                    stream=True,
                )
                break
            except httpx.TransportError as exc:
                backend.in_flight -= 1
                self.mark_down(backend, repr(exc))
        else:
            return openai_error(503, "no kvserve instance is available")
        backend.routed += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                backend.in_flight -= 1

        headers = {"x-kvserve-backend": backend.url}
        if not body.get("stream"):
            try:
                content = await upstream.aread()
            finally:
                await upstream.aclose()
                release()
            media = upstream.headers.get("content-type", "application/json")
            return Response(content, upstream.status_code, headers=headers, media_type=media)

        async def relay() -> AsyncIterator[bytes]:
            # Closing the upstream stream when the client goes (this generator is
            # cancelled) drops the instance's connection, which aborts the request there.
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()
                release()

        return StreamingResponse(
            relay(), upstream.status_code, headers=headers,
            media_type=upstream.headers.get("content-type", "text/event-stream"),
        )  # fmt: skip

    async def health_loop(self) -> None:
        while True:
            for backend in self.backends:
                try:
                    ok = (
                        await self.client.get(f"{backend.url}/health", timeout=2.0)
                    ).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok and not backend.healthy:
                    logger.info("%s is back in the rotation", backend.url)
                    backend.healthy = True
                elif not ok:
                    self.mark_down(backend, "/health failed")
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def models(self) -> Response:
        for backend in self.healthy():
            try:
                answer = await self.client.get(
                    f"{backend.url}/v1/models", headers=self.keys.headers(backend.url)
                )
            except httpx.TransportError as exc:
                self.mark_down(backend, repr(exc))
                continue
            return Response(answer.content, answer.status_code, media_type="application/json")
        return openai_error(503, "no kvserve instance is available")

    async def is_healthy(self) -> bool:
        return bool(self.healthy())

    def metrics_text(self) -> str:
        lines = [
            "# TYPE kvserve_router_requests_total counter",
            *(
                f'kvserve_router_requests_total{{backend="{b.url}"}} {b.routed}'
                for b in self.backends
            ),
            "# TYPE kvserve_router_backend_healthy gauge",
            *(
                f'kvserve_router_backend_healthy{{backend="{b.url}"}} {int(b.healthy)}'
                for b in self.backends
            ),
            "# TYPE kvserve_router_indexed_blocks gauge",
            *(
                f'kvserve_router_indexed_blocks{{backend="{b.url}"}} {self.index.num_blocks(b.url)}'
                for b in self.backends
            ),
            "# TYPE kvserve_router_prefix_tokens_matched_total counter",
            f"kvserve_router_prefix_tokens_matched_total {self.prefix_tokens_matched}",
        ]
        return "\n".join(lines) + "\n"


def build_app(router: Router, keys: Mapping[bytes, str | None] | None = None) -> FastAPI:
    @asynccontextmanager
    async def running() -> AsyncIterator[None]:
        router.followers.start()
        health = asyncio.create_task(router.health_loop())
        try:
            yield
        finally:
            health.cancel()
            router.followers.stop()
            await router.client.aclose()

    return build_front_door_app(router, running, keys)


def add_router_parser(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "router", help="route requests over several instances by their cached prefixes"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--backend", action="append", required=True, metavar="URL=EVENTS[,REPLAY]",
        help="an instance and its KV events endpoints (as given to its --kv-events-config), "
        "e.g. http://127.0.0.1:8001=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558; repeat",
    )  # fmt: skip
    parser.add_argument("--block-size", type=int, default=16, help="the instances' block size")
    parser.add_argument(
        "--prefix-caching-hash-seed", type=int, default=0, help="the instances' hash seed"
    )
    parser.add_argument("--policy", choices=POLICIES, default="prefix")
    parser.add_argument(
        "--controller", default=None, metavar="URL",
        help="a `kvserve cache-controller` to take cached prefixes from (every tier: device, "
        "cpu, disk, remote), instead of following the instances' events; --backend is then "
        "the plain URL each instance registered with",
    )  # fmt: skip
    parser.add_argument(
        "--controller-api-key", default=None, help="the cache controller's --api-key"
    )
    add_front_door_auth_args(parser)
    add_kv_secret_arg(parser)
    parser.set_defaults(func=router_main)


def router_main(args: argparse.Namespace) -> int:
    import uvicorn

    backends = [Backend.parse(spec, args.controller is None) for spec in args.backend]
    controller = (
        None
        if args.controller is None
        else ControllerLookup(args.controller, args.controller_api_key)
    )
    router = Router(
        backends,
        args.block_size,
        args.prefix_caching_hash_seed,
        args.policy,
        UpstreamKeys(args.backend_api_key),
        socket_security(read_kv_secret(args.kv_secret_file)),
        controller,
    )
    app = build_app(router, front_door_keys(args))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
