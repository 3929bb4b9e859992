"""The server's middlewares on the Anthropic routes, on a real FastAPI app (Starlette's
TestClient, no server process): with --api-key they take `x-api-key` as well as a bearer
token, and refusals (a wrong key, a full server) come in Anthropic's error shape, the full
server as Anthropic's 529 overloaded_error; the OpenAI routes keep their own shapes."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from kvserve.entrypoints.openai.admission import AdmissionMiddleware
from kvserve.entrypoints.openai.anthropic_errors import AnthropicErrorMiddleware
from kvserve.entrypoints.openai.http_middleware import ApiKeyMiddleware

KEY = "anthropic-test-key"


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/messages/count_tokens")
    @app.post("/v1/chat/completions")
    async def answered() -> JSONResponse:
        return JSONResponse({"ok": True})

    return app


def test_x_api_key_or_bearer_on_v1_messages() -> None:
    app = _app()
    app.add_middleware(ApiKeyMiddleware, keys={f"Bearer {KEY}".encode(): None})
    app.add_middleware(AnthropicErrorMiddleware)
    client = TestClient(app)
    path = "/v1/messages/count_tokens"
    for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}):
        assert client.post(path, headers=headers).status_code == 200
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": KEY}):
        denied = client.post(path, headers=headers)
        assert denied.status_code == 401
        assert denied.json() == {
            "type": "error",
            "error": {"type": "authentication_error", "message": "Incorrect or missing API key."},
        }
    # x-api-key is Anthropic's header: the OpenAI routes ask for the bearer token.
    openai = client.post("/v1/chat/completions", headers={"x-api-key": KEY})
    assert openai.status_code == 401 and openai.json()["error"]["code"] == 401


def test_a_full_server_is_overloaded_error_on_v1_messages() -> None:
    app = _app()
    app.add_middleware(
        AdmissionMiddleware, max_running=0, max_queued=0, retry_after_s=2, draining=lambda: False
    )
    app.add_middleware(AnthropicErrorMiddleware)
    client = TestClient(app)
    anthropic = client.post("/v1/messages", json={})
    assert anthropic.status_code == 529
    assert anthropic.headers["retry-after"] == "2"
    body = anthropic.json()
    assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
    assert "capacity" in body["error"]["message"]
    openai = client.post("/v1/chat/completions", json={})
    assert openai.status_code == 503 and openai.json()["error"]["code"] == 503
