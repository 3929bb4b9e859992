"""OpenAI's audio routes, ``POST /v1/audio/transcriptions`` and
``POST /v1/audio/translations``: a multipart upload (the ``file`` part and text fields,
as the openai SDK sends them) run on the named model's stack
(serving_transcription.py). A body that is not multipart, or a form without a file,
is a 400 in OpenAI's error shape."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.formparsers import MultiPartException

from kvserve.entrypoints.openai.protocol import OpenAIServingError
from kvserve.entrypoints.openai.protocol_audio import parse_audio_form
from kvserve.entrypoints.openai.serving_stack import ServingStack
from kvserve.multimodal.audio import AudioPolicy

# Room for the form's text fields and part headers beside the file.
_FORM_OVERHEAD_BYTES = 64 << 10

# The form as OpenAPI describes it (the route reads the body itself, so FastAPI cannot).
_FORM_SCHEMA: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "model": {"type": "string"},
                        "language": {"type": "string"},
                        "prompt": {"type": "string"},
                        "response_format": {"enum": ["json", "text", "verbose_json"]},
                        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
                        "max_completion_tokens": {"type": "integer", "minimum": 1},
                    },
                }
            }
        },
    }
}

Serve = Callable[
    [Request, str | None, Callable[[ServingStack], Awaitable[Any]]], Awaitable[Response]
]


def register_audio_routes(app: FastAPI, serve: Serve) -> None:
    async def audio(raw_request: Request, task: Literal["transcribe", "translate"]) -> Response:
        content_type = raw_request.headers.get("content-type", "")
        if not content_type.startswith("multipart/form-data"):
            raise OpenAIServingError(
                f"expected a multipart/form-data upload, got {content_type or 'no content type'!r}"
            )
        limit = AudioPolicy().max_file_bytes
        length = raw_request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit + _FORM_OVERHEAD_BYTES:
            raise OpenAIServingError(
                f"file: the upload has {length} bytes, more than the limit of {limit}",
                param="file",
            )
        try:
            form = await raw_request.form()
        except MultiPartException as exc:
            raise OpenAIServingError(f"malformed multipart body: {exc.message}") from None
        try:
            request, data = await parse_audio_form(form, limit)
        finally:
            await form.close()
        return await serve(
            raw_request,
            request.model,
            lambda stack: stack.transcription.create(request, data, raw_request, task),
        )

    @app.post("/v1/audio/transcriptions", openapi_extra=_FORM_SCHEMA)
    async def create_transcription(raw_request: Request) -> Response:
        return await audio(raw_request, "transcribe")

    @app.post("/v1/audio/translations", openapi_extra=_FORM_SCHEMA)
    async def create_translation(raw_request: Request) -> Response:
        return await audio(raw_request, "translate")
