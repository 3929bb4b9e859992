"""The server's own ASGI middlewares: the request id echo, the API key (and the request's
tenant), and the order the guards are installed in (key, admission, body size)."""

from __future__ import annotations

import argparse
import secrets
from collections.abc import Mapping

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.engine.engine_client import EngineClient
from kvserve.entrypoints.openai.admission import (
    AdmissionMiddleware,
    BodySizeLimitMiddleware,
    error_response,
)
from kvserve.entrypoints.openai.anthropic_errors import ANTHROPIC_PATH_PREFIX
from kvserve.entrypoints.openai.protocol import OpenAIServingError
from kvserve.entrypoints.openai.tenants import (
    bearer_keys,
    current_tenant,
    enable_tenant_metrics,
)
from kvserve.entrypoints.web.routes import PUBLIC_PATHS as WEB_UI_PAGES
from kvserve.entrypoints.web.routes import STATIC_PREFIX as WEB_UI_ASSETS

# Reachable without the API key: probes, the version and the API's own schema (no data).
OPEN_PATHS = frozenset({"/health", "/version", "/openapi.json", "/docs", "/redoc"})


class RequestIdMiddleware:
    """Echoes the client's X-Request-Id on the response (the handlers use it as request id)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = dict(scope["headers"]).get(b"x-request-id")

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start" and request_id:
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id)]
            await send(message)

        await self.app(scope, receive, send_with_id)


class ApiKeyMiddleware:
    """`Authorization: Bearer <key>` on every route that exposes data or runs the model
    (on the Anthropic routes `x-api-key: <key>` too, which Anthropic's clients send).

    Only OPEN_PATHS, the web UI's pages and assets (they hold no data; the pages ask for
    the key), /metrics unless ``metrics_auth``, and CORS preflights stay open.
    The key is compared in constant time (secrets.compare_digest).
    """

    def __init__(
        self, app: ASGIApp, keys: Mapping[bytes, str | None], metrics_auth: bool = False
    ) -> None:
        self.app = app
        self.keys = keys  # accepted Authorization values -> their tenant (tenants.py)
        self.open_paths = OPEN_PATHS | WEB_UI_PAGES | (set() if metrics_auth else {"/metrics"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] != "OPTIONS"
            and scope["path"] not in self.open_paths
            and not scope["path"].startswith(WEB_UI_ASSETS + "/")
        ):
            headers = dict(scope["headers"])
            given = [headers.get(b"authorization", b"")]
            if scope["path"].startswith(ANTHROPIC_PATH_PREFIX):
                given.append(b"Bearer " + headers.get(b"x-api-key", b""))
            # Every key is compared, so the time taken does not say which one matched.
            matched = [k for k in self.keys for g in given if secrets.compare_digest(g, k)]
            if not matched:
                err = OpenAIServingError(
                    "Incorrect or missing API key.", status=401, err_type="AuthenticationError"
                )
                await error_response(err)(scope, receive, send)
                return
            token = current_tenant.set(self.keys[matched[0]])
            try:
                await self.app(scope, receive, send)
            finally:
                current_tenant.reset(token)
            return
        await self.app(scope, receive, send)


def add_hardening_middleware(
    app: FastAPI, engine_client: EngineClient, args: argparse.Namespace
) -> None:
    """API key, admission control and the body-size bound (outermost last)."""
    keys = bearer_keys(getattr(args, "api_key", None), getattr(args, "api_key_file", None))
    if any(tenant is not None for tenant in keys.values()):
        enable_tenant_metrics(engine_client.config.metrics_prefix)
    if keys:
        app.add_middleware(
            ApiKeyMiddleware, keys=keys, metrics_auth=getattr(args, "metrics_auth", False)
        )
    max_queued = getattr(args, "max_queued_requests", None)
    if max_queued is not None:

        def draining() -> bool:
            server = app.state.server
            return server is not None and bool(server.should_exit)

        app.add_middleware(
            AdmissionMiddleware,
            max_running=engine_client.config.scheduler_config.max_num_seqs,
            max_queued=max_queued,
            retry_after_s=getattr(args, "retry_after", 1.0),
            draining=draining,
        )
    max_body = getattr(args, "max_request_body_size", None)
    if max_body is not None:
        app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body)
