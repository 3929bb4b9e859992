"""vLLM's sleep-mode routes: ``POST /sleep?level=1|2``, ``POST /wake_up`` (``tags`` query
parameters: weights, kv_cache; none: all) and ``GET /is_sleeping`` -> ``{"is_sleeping": bool}``.

vLLM serves them in its dev mode (VLLM_SERVER_DEV_MODE); kvserve with --enable-sleep-mode,
and behind --api-key like every route that is not open. Each takes an optional ``model``
query parameter: ``engine_for`` maps it to the engine it acts on (404 for a model not
served), holding that model loaded for the call, so a server of several models points
each call at the right one.

While the engine sleeps, generation requests get a 503 (serving_engine.engine_error).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Annotated

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse, Response

from kvserve.engine.engine_client import EngineClient
from kvserve.engine.exceptions import EngineBusyError
from kvserve.entrypoints.openai.protocol import OpenAIServingError
from kvserve.protocol.sleep_mode import check_sleep_level, check_wake_tags

EngineFor = Callable[[str | None], AbstractAsyncContextManager[EngineClient]]


def register_sleep_routes(app: FastAPI, engine_for: EngineFor) -> None:
    @app.post("/sleep")
    async def sleep(level: int = 1, model: str | None = None) -> Response:
        try:
            check_sleep_level(level)
        except ValueError as exc:
            raise OpenAIServingError(str(exc), param="level") from None
        try:
            async with engine_for(model) as engine:
                await engine.sleep(level)
        except EngineBusyError as exc:
            # The requests' KV would go with the cache: the caller retries once they end.
            raise OpenAIServingError(str(exc), status=409, err_type="ConflictError") from None
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(
        tags: Annotated[list[str] | None, Query()] = None, model: str | None = None
    ) -> Response:
        try:
            check_wake_tags(tags)
        except ValueError as exc:
            raise OpenAIServingError(str(exc), param="tags") from None
        async with engine_for(model) as engine:
            await engine.wake_up(tags)
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping(model: str | None = None) -> JSONResponse:
        async with engine_for(model) as engine:
            return JSONResponse({"is_sleeping": await engine.is_sleeping()})
