"""Anthropic's error shape on the Anthropic routes, on a real FastAPI app with the server's
middlewares (Starlette's TestClient, no server process): the admission refusal is
Anthropic's 529 overloaded_error there, and stays OpenAI's 503 elsewhere."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient

from kvserve.entrypoints.openai.admission import AdmissionMiddleware
from kvserve.entrypoints.openai.anthropic_errors import AnthropicErrorMiddleware


def test_a_full_server_is_overloaded_error_on_v1_messages() -> None:
    app = FastAPI()
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
