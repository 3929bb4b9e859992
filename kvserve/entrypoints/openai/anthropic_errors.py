"""Anthropic's error shape on the Anthropic routes: ``{"type": "error", "error": {"type",
"message"}}``, which Anthropic's SDKs read to pick their exception class.

Every layer of the server (the API key and admission middlewares, request validation, the
serving classes) raises and answers errors in OpenAI's shape; on ``/v1/messages*`` the
middleware here rewrites those answers, so each error keeps one source. A 503 (at capacity,
draining, or the engine gone) becomes Anthropic's 529 ``overloaded_error``, the status
Anthropic's clients back off and retry on; ``Retry-After`` is kept.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.entrypoints.openai.protocol import OpenAIServingError
from kvserve.entrypoints.openai.protocol_anthropic import (
    AnthropicErrorInfo,
    AnthropicErrorResponse,
)

ANTHROPIC_PATH_PREFIX = "/v1/messages"
OVERLOADED_STATUS = 529
# HTTP status -> (Anthropic's status, Anthropic's error type).
_ERRORS: dict[int, tuple[int, str]] = {
    400: (400, "invalid_request_error"),
    401: (401, "authentication_error"),
    403: (403, "permission_error"),
    404: (404, "not_found_error"),
    408: (408, "timeout_error"),
    413: (413, "request_too_large"),
    429: (429, "rate_limit_error"),
    500: (500, "api_error"),
    503: (OVERLOADED_STATUS, "overloaded_error"),
}


def anthropic_error(status: int, message: str) -> tuple[int, AnthropicErrorResponse]:
    """Anthropic's status and body for an error the server answered with ``status``."""
    default = (status, "invalid_request_error" if status < 500 else "api_error")
    new_status, kind = _ERRORS.get(status, default)
    return new_status, AnthropicErrorResponse(error=AnthropicErrorInfo(type=kind, message=message))


def error_event(err: OpenAIServingError) -> str:
    """The SSE ``error`` event that ends an Anthropic stream."""
    _, body = anthropic_error(err.status, err.message)
    return sse_event("error", body.model_dump())


def sse_event(kind: str, data: dict[str, Any]) -> str:
    # ensure_ascii: no raw U+2028 or U+0085 that line-splitting SSE readers break on.
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class AnthropicErrorMiddleware:
    """Rewrites OpenAI-shaped error responses on the Anthropic routes into Anthropic's shape."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(ANTHROPIC_PATH_PREFIX):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        body = b""

        async def rewriting_send(message: Message) -> None:
            nonlocal start, body
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until the body is complete
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                await self._send_rewritten(start, body, send)

        await self.app(scope, receive, rewriting_send)

    @staticmethod
    async def _send_rewritten(start: Message, body: bytes, send: Send) -> None:
        status = start["status"]
        try:
            message = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = None  # not one of the server's error bodies: passed on as it is
        if isinstance(message, str):
            status, anthropic = anthropic_error(status, message)
            body = anthropic.model_dump_json().encode()
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({**start, "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
