"""The web UI's routes: two static pages, their assets and the dashboard's stats endpoint.

The pages and assets are public (they hold no data: PUBLIC_PATHS and STATIC_PREFIX, which
the server's API-key middleware leaves open); ``GET /dashboard/stats`` carries the engine's
numbers and so, with ``--api-key``, asks for the same Bearer key as /v1/*. The pages let
the user enter that key and send it with every call they make.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Protocol

from fastapi import APIRouter, FastAPI, Query
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from kvserve.metrics.history import StatsHistory
from kvserve.metrics.loggers import StatLoggerBase

STATIC_DIR = Path(__file__).parent / "static"
STATIC_PREFIX = "/static"
PUBLIC_PATHS = frozenset({"/", "/dashboard"})


class StatsSource(Protocol):
    """A served model, whose engine's stats (across its reloads) the dashboard records."""

    name: str

    def add_stat_logger(self, stat_logger: StatLoggerBase) -> None: ...


def register_web_ui(app: FastAPI, model: StatsSource, args: argparse.Namespace) -> None:
    """Serves the web UI on ``app`` unless ``--disable-web-ui`` (then neither ``app`` nor
    ``model`` is touched); the dashboard's history records the model's engine stats
    from now on."""
    if getattr(args, "disable_web_ui", False):
        return
    history = StatsHistory(model.name)
    model.add_stat_logger(history)
    mount_web_ui(app, history)


def mount_web_ui(app: FastAPI, history: StatsHistory) -> None:
    """The pages, their assets under /static, and the stats endpoint over ``history``."""
    app.include_router(build_web_ui_router(history))
    app.mount(STATIC_PREFIX, StaticFiles(directory=STATIC_DIR), name="web-ui-static")


def build_web_ui_router(history: StatsHistory) -> APIRouter:
    """`/`, `/dashboard` and `GET /dashboard/stats?since=<unix seconds>` over ``history``."""
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(STATIC_DIR / "playground.html")

    @router.get("/dashboard", include_in_schema=False)
    async def dashboard() -> FileResponse:
        return FileResponse(STATIC_DIR / "dashboard.html")

    @router.get("/dashboard/stats")
    async def dashboard_stats(
        since: float = Query(0.0, ge=0.0, description="only history samples after this time"),
    ) -> JSONResponse:
        return JSONResponse(history.snapshot(since), headers={"Cache-Control": "no-store"})

    return router
