"""The OpenAI-compatible app of kvserve's fronts over other instances (`kvserve router`,
`kvserve proxy`): the same routes and error body, whatever decides where requests go."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

PROMETHEUS_TEXT = "text/plain; version=0.0.4"


def openai_error(status: int, message: str, kind: str = "ServiceUnavailableError") -> JSONResponse:
    """An error in OpenAI's body shape, as the instances behind the front answer."""
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}},
        status_code=status,
    )


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
    door: FrontDoor, running: Callable[[], AbstractAsyncContextManager[None]]
) -> FastAPI:
    """The app; ``running`` is entered for the app's lifetime (start and stop the front's
    background work and close its HTTP client there)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with running():
            yield

    app = FastAPI(lifespan=lifespan)

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
