"""Admission control at the front door: a bound on request bodies and on queued generations.

Both are ASGI middlewares so that a refused request costs neither a JSON parse nor a slot
in the engine: an oversized body is a 413 before it is buffered in full, and a generation
beyond the bound is a 503 with ``Retry-After`` before it reaches the engine, never an
unbounded waiting queue.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.entrypoints.openai.protocol import OpenAIServingError

# The routes that start a generation (and so hold engine resources while they run);
# an embedding request runs its prompt through the model the same way.
GENERATION_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/messages"}
)


def error_response(err: OpenAIServingError) -> JSONResponse:
    """OpenAI's error body with the error's status (and headers, e.g. Retry-After)."""
    return JSONResponse(err.to_response().model_dump(), status_code=err.status, headers=err.headers)


class BodySizeLimitMiddleware:
    """Refuses request bodies over ``max_bytes`` with a 413.

    A declared Content-Length over the limit is refused before any byte is read; a chunked
    body is read up to the limit and refused as soon as it passes it. Accepted bodies are
    replayed to the app unchanged.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        buffered: list[Message] = []
        size = 0
        while True:
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                break  # a disconnect: the app sees it in turn
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        err = OpenAIServingError(
            f"The request body is larger than this server's limit of {self.max_bytes} bytes.",
            status=413,
        )
        await error_response(err)(scope, receive, send)


class AdmissionMiddleware:
    """Bounds the generation requests in flight; beyond the bound, 503 + Retry-After.

    ``max_running`` requests run in the engine's batch at once (its max_num_seqs); up to
    ``max_queued`` more may wait for a slot. A request counts from its arrival until its
    response (streamed or not) has been sent or abandoned. ``draining()`` turns every new
    generation away too, with the same answer, while SIGTERM lets the admitted ones finish.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_running: int,
        max_queued: int,
        retry_after_s: float,
        draining: Callable[[], bool],
    ) -> None:
        self.app = app
        self.limit = max_running + max_queued
        self.max_queued = max_queued
        self.retry_after = str(max(1, math.ceil(retry_after_s)))
        self.draining = draining
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or scope["path"] not in GENERATION_PATHS
        ):
            await self.app(scope, receive, send)
            return
        if self.draining():
            await self._refuse("The server is shutting down.", scope, receive, send)
            return
        if self.in_flight >= self.limit:
            await self._refuse(
                f"The server is at capacity ({self.limit - self.max_queued} running and "
                f"{self.max_queued} queued requests). Retry later.",
                scope,
                receive,
                send,
            )
            return
        # One event loop: the check above and this increment cannot interleave.
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _refuse(self, message: str, scope: Scope, receive: Receive, send: Send) -> None:
        err = OpenAIServingError(message, status=503, headers={"Retry-After": self.retry_after})
        await error_response(err)(scope, receive, send)
