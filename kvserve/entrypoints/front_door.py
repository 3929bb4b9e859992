"""The OpenAI-compatible app of kvserve's fronts over other instances (`kvserve router`,
`kvserve proxy`): the same routes and error body, whatever decides where requests go."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvserve.entrypoints.openai.tenants import bearer_keys, current_tenant
from kvserve.inputs import UNPAIRED_SURROGATE, unpaired_surrogate_path

PROMETHEUS_TEXT = "text/plain; version=0.0.4"
# Reachable without the front's key: the probe and (as on `kvserve serve`) the metrics.
OPEN_PATHS = frozenset({"/health", "/metrics"})


def openai_error(status: int, message: str, kind: str = "ServiceUnavailableError") -> JSONResponse:
    """An error in OpenAI's body shape, as the instances behind the front answer."""
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}},
        status_code=status,
    )


async def json_object_body(request: Request) -> dict[str, Any] | JSONResponse:
    """The request's JSON object, or the 400 that says what is wrong with it: not JSON,
    not an object, or a string the front could not forward (an unpaired surrogate escape
    has no UTF-8 form, so re-encoding the body for the instance would fail)."""
    try:
        body = await request.json()
    except ValueError:
        return openai_error(400, "the request body is not JSON", "BadRequestError")
    if not isinstance(body, dict):
        return openai_error(400, "the request body must be a JSON object", "BadRequestError")
    path = unpaired_surrogate_path(body)
    if path is not None:
        field = ".".join(str(p) for p in path)
        return openai_error(400, f"{field} {UNPAIRED_SURROGATE}", "BadRequestError")
    return body


class UpstreamKeys:
    """The key a front sends each instance behind it: ``--backend-api-key KEY`` (every
    instance) or ``URL=KEY`` (that one; repeat). An instance with no key configured gets
    the client's own Authorization header, as before keys were configurable."""

    def __init__(self, specs: Sequence[str] = ()) -> None:
        self.default: str | None = None
        self.by_url: dict[str, str] = {}
        for spec in specs:
            url, sep, key = spec.rpartition("=")
            if sep and url.startswith(("http://", "https://")):
                self.by_url[url.rstrip("/")] = key
            else:
                self.default = spec

    def headers(self, url: str, request: Request | None = None) -> dict[str, str]:
        key = self.by_url.get(url, self.default)
        if key is not None:
            return {"authorization": f"Bearer {key}"}
        if request is None:
            return {}
        return {k: v for k, v in request.headers.items() if k.lower() == "authorization"}


def add_front_door_auth_args(parser: Any) -> None:
    parser.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer <key>` on every route but /health and /metrics",
    )
    parser.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="the instances' tenants ('KEY TENANT' per line, as given to their "
        "--api-key-file): clients' keys are checked here and forwarded, and each tenant's "
        "requests are routed by its own cached prefixes",
    )
    parser.add_argument(
        "--backend-api-key",
        action="append",
        default=[],
        metavar="KEY|URL=KEY",
        help="the key sent to the instances behind (their --api-key): one for all, or "
        "URL=KEY per instance; repeat. Without it the client's Authorization is forwarded",
    )


def front_door_keys(args: Any) -> Mapping[bytes, str | None]:
    """The keys a front's clients must send; tenants need the instances to see each
    client's own key, so they exclude --backend-api-key."""
    if args.api_key_file and args.backend_api_key:
        raise SystemExit(
            "--api-key-file and --backend-api-key exclude each other: the instances tell "
            "tenants apart by the key each client sends, which the front forwards"
        )
    return bearer_keys(args.api_key, args.api_key_file)


class FrontDoor(Protocol):
    async def forward(self, request: Request, path: str) -> Response:
        """Answers a completion or chat request (``path``) through the instances."""
        ...

    async def models(self) -> Response:
        """/v1/models of an instance that answers (503 when none does)."""
        ...

    async def is_healthy(self) -> bool: ...

    def metrics_text(self) -> str | bytes:
        """The front's own Prometheus metrics (text format)."""
        ...


def build_front_door_app(
    door: FrontDoor,
    running: Callable[[], AbstractAsyncContextManager[None]],
    keys: Mapping[bytes, str | None] | None = None,
) -> FastAPI:
    """The app; ``running`` is entered for the app's lifetime (start and stop the front's
    background work and close its HTTP client there). ``keys``: the Authorization values
    clients must send (openai/tenants.py: bearer_keys), each with its tenant."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with running():
            yield

    app = FastAPI(lifespan=lifespan)
    if keys:

        @app.middleware("http")
        async def require_key(
            request: Request, call_next: Callable[[Request], Awaitable[Response]]
        ) -> Response:
            if request.url.path in OPEN_PATHS:
                return await call_next(request)
            given = request.headers.get("authorization", "").encode()
            # Every key is compared, so the time taken does not say which one matched.
            matched = [k for k in keys if secrets.compare_digest(given, k)]
            if not matched:
                return openai_error(401, "a valid API key is required", "AuthenticationError")
            token = current_tenant.set(keys[matched[0]])
            try:
                return await call_next(request)
            finally:
                current_tenant.reset(token)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await door.forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await door.forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        return await door.models()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if await door.is_healthy() else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(door.metrics_text(), media_type=PROMETHEUS_TEXT)

    return app
