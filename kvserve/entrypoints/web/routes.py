"""The web UI's routes: two static pages, their assets and the dashboard's stats endpoint.

The pages and assets are public (they hold no data); ``GET /dashboard/stats`` carries the
engine's numbers and so, with ``--api-key``, asks for the same Bearer key as /v1/*. The
pages let the user enter that key and send it with every call they make.
"""

from __future__ import annotations

import argparse
import secrets
from pathlib import Path

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from kvserve.engine.protocol import EngineClient
from kvserve.entrypoints.openai.protocol import OpenAIServingError
from kvserve.metrics.history import StatsHistory

STATIC_DIR = Path(__file__).parent / "static"
STATIC_PREFIX = "/static"


def register_web_ui(app: FastAPI, engine_client: EngineClient, args: argparse.Namespace) -> None:
    """Serves the web UI on ``app`` unless ``--disable-web-ui`` (then neither ``app`` nor
    ``engine_client`` is touched); the dashboard's history records the engine's stats
    from now on."""
    if getattr(args, "disable_web_ui", False):
        return
    history = StatsHistory(engine_client.model_config.served_model_name or "model")
    engine_client.add_stat_logger(history)
    mount_web_ui(app, history, getattr(args, "api_key", None))


def mount_web_ui(app: FastAPI, history: StatsHistory, api_key: str | None) -> None:
    """The pages, their assets under /static, and the stats endpoint over ``history``."""
    app.include_router(build_web_ui_router(history, api_key))
    app.mount(STATIC_PREFIX, StaticFiles(directory=STATIC_DIR), name="web-ui-static")


def build_web_ui_router(history: StatsHistory, api_key: str | None) -> APIRouter:
    """`/`, `/dashboard` and `GET /dashboard/stats?since=<unix seconds>` over ``history``."""
    router = APIRouter()
    expected = f"Bearer {api_key}".encode() if api_key else None

    def authorized(request: Request) -> bool:
        if expected is None:
            return True
        return secrets.compare_digest(request.headers.get("authorization", "").encode(), expected)

    @router.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(STATIC_DIR / "playground.html")

    @router.get("/dashboard", include_in_schema=False)
    async def dashboard() -> FileResponse:
        return FileResponse(STATIC_DIR / "dashboard.html")

    @router.get("/dashboard/stats")
    async def dashboard_stats(
        request: Request,
        since: float = Query(0.0, ge=0.0, description="only history samples after this time"),
    ) -> JSONResponse:
        if not authorized(request):
            err = OpenAIServingError(
                "Incorrect or missing API key.", status=401, err_type="AuthenticationError"
            )
            return JSONResponse(err.to_response().model_dump(), status_code=err.status)
        return JSONResponse(history.snapshot(since), headers={"Cache-Control": "no-store"})

    return router
