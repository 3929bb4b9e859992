"""The web UI's routes on a real FastAPI app (Starlette's TestClient, no server process):
--disable-web-ui leaves them out, the pages and assets are public, the stats endpoint asks
for the API key and returns StatsHistory's document."""

from __future__ import annotations

import argparse

from fastapi import FastAPI
from fastapi.testclient import TestClient

from kvserve.entrypoints.openai.cli_args import add_serve_args
from kvserve.entrypoints.openai.http_middleware import ApiKeyMiddleware
from kvserve.entrypoints.web import mount_web_ui, register_web_ui
from kvserve.entrypoints.web.routes import STATIC_DIR
from kvserve.metrics.history import StatsHistory
from kvserve.protocol.engine_core import SchedulerStats

WEB_UI_PATHS = ("/", "/dashboard", "/dashboard/stats", "/static/playground.js")


def _parse(*argv: str) -> argparse.Namespace:
    return add_serve_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_disable_web_ui_removes_the_routes() -> None:
    assert _parse().disable_web_ui is False  # on by default
    app = FastAPI()
    # Disabled, it touches neither the app nor the engine client (hence None here).
    register_web_ui(app, None, _parse("--disable-web-ui"))  # type: ignore[arg-type]
    client = TestClient(app)
    assert [client.get(path).status_code for path in WEB_UI_PATHS] == [404] * len(WEB_UI_PATHS)
    mount_web_ui(app, StatsHistory("m"))
    assert [client.get(path).status_code for path in WEB_UI_PATHS] == [200] * len(WEB_UI_PATHS)


def test_pages_are_public_and_the_stats_need_the_key() -> None:
    history = StatsHistory("m")
    history.record(SchedulerStats(num_running_reqs=3, kv_cache_usage=0.125), None)
    app = FastAPI()
    mount_web_ui(app, history)
    # The server's own middleware, as build_app adds it with --api-key.
    app.add_middleware(ApiKeyMiddleware, keys={b"Bearer secret": None})
    client = TestClient(app)
    for path, marker in (("/", "playground.js"), ("/dashboard", "dashboard.js")):
        page = client.get(path)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert marker in page.text
    # Every asset the pages name is shipped (no CDN: nothing is fetched from elsewhere).
    for asset in sorted(STATIC_DIR.iterdir()):
        response = client.get(f"/static/{asset.name}")
        assert response.status_code == 200, asset.name
        assert "http://" not in response.text.replace("http://www.w3.org/2000/svg", "")
        assert "https://" not in response.text
    assert client.get("/dashboard/stats").status_code == 401
    wrong = client.get("/dashboard/stats", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert wrong.json()["error"]["type"] == "AuthenticationError"
    ok = client.get("/dashboard/stats", headers={"Authorization": "Bearer secret"})
    assert ok.status_code == 200 and ok.headers["cache-control"] == "no-store"
    snap = ok.json()
    assert snap["model"] == "m"
    assert snap["current"] == {
        "num_running_reqs": 3,
        "num_waiting_reqs": 0,
        "kv_cache_usage": 0.125,
    }
    assert set(snap) >= {"time", "start_time", "window_s", "totals", "tiers", "history"}
