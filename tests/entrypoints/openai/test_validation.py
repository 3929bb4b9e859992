"""Every field is checked at the front door: no request content takes the engine down.

The two reported crashes first (a "nan" temperature killed the engine core; a negative
prompt token id was a 500), then the per-request limits, each a 400 in OpenAI's error
shape naming the field; after all of them the shared server still serves and is healthy.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from kvserve.entrypoints.openai.protocol import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
)
from tests.entrypoints.openai.utils import RemoteServer

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "hi"}]
CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"

# (endpoint, body, the param the 400 must name)
INVALID: list[tuple[str, dict[str, Any], str]] = [
    # the two reported bugs
    (CMPL, {"prompt": "hi", "temperature": "nan"}, "temperature"),
    (CMPL, {"prompt": [1, -5, 3], "max_tokens": 1}, "prompt"),
    # non-finite numbers anywhere
    (CHAT, {"messages": HI, "temperature": "NaN"}, "temperature"),
    (CMPL, {"prompt": "hi", "top_p": "inf"}, "top_p"),
    (CMPL, {"prompt": "hi", "presence_penalty": "-Infinity"}, "presence_penalty"),
    (CMPL, {"prompt": "hi", "repetition_penalty": "nan"}, "repetition_penalty"),
    (CMPL, {"prompt": "hi", "min_p": "nan"}, "min_p"),
    (CMPL, {"prompt": "hi", "logit_bias": {"5": "nan"}}, "logit_bias"),
    # ranges
    (CMPL, {"prompt": "hi", "temperature": -0.5}, "temperature"),
    (CMPL, {"prompt": "hi", "top_p": 0}, "top_p"),
    (CMPL, {"prompt": "hi", "top_k": -2}, "top_k"),
    (CMPL, {"prompt": "hi", "frequency_penalty": 3}, "frequency_penalty"),
    (CMPL, {"prompt": "hi", "seed": 2**64}, "seed"),
    (CMPL, {"prompt": "hi", "priority": 2**70}, "priority"),
    (CMPL, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    (CMPL, {"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    (CMPL, {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    # the vocabulary
    (CMPL, {"prompt": [[1, 2], [10**9]], "max_tokens": 1}, "prompt"),
    (CMPL, {"prompt": "hi", "stop_token_ids": [10**9]}, "stop_token_ids"),
    (CMPL, {"prompt": "hi", "logit_bias": {"999999999": 1}}, "logit_bias"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    # per-request limits
    (CMPL, {"prompt": "hi", "n": MAX_N + 1}, "n"),
    (CMPL, {"prompt": "hi", "best_of": 3}, "best_of"),
    (CMPL, {"prompt": "hi", "logprobs": 21}, "logprobs"),
    (CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CMPL, {"prompt": "hi", "stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    (CMPL, {"prompt": "hi", "stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop"),
    (
        CMPL,
        {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}},
        "logit_bias",
    ),
    # an image for a text-only model (its chat template raised a TypeError: a 500)
    (
        CHAT,
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                    ],
                }
            ]
        },
        "messages",
    ),
]


@pytest.mark.parametrize(("path", "body", "param"), INVALID)
def test_invalid_field_is_a_400_naming_it(
    server: RemoteServer, path: str, body: dict[str, Any], param: str
) -> None:
    response = httpx.post(server.url(path), json={"max_tokens": 2, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert error["param"] == param, error
    assert "Traceback" not in error["message"]


@pytest.mark.parametrize(
    ("path", "body", "param", "where"),
    [
        (CMPL, {"prompt": "a\ud800b"}, "prompt", "prompt"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": "\udc00"}]},
            "messages",
            "messages.0.content",
        ),
        (CHAT, {"messages": HI, "stop": ["ok", "\ud83d"]}, "stop", "stop.1"),
        (
            CHAT,
            {
                "messages": [
                    *HI,
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "f", "arguments": '{"x": "\ud800"}'},
                            },
                        ],
                    },
                ]
            },
            "messages",
            "messages.1.tool_calls.0.function.arguments",
        ),
        ("/v1/responses", {"input": "\ud800"}, "input", "input"),
        ("/v1/embeddings", {"input": ["ok", "\udfff"]}, "input", "input.1"),
        ("/tokenize", {"prompt": "\ud800"}, "prompt", "prompt"),
    ],
)
def test_an_unpaired_surrogate_escape_is_a_400_naming_its_field(
    server: RemoteServer, path: str, body: dict[str, Any], param: str, where: str
) -> None:
    """ "\\ud800" alone is legal JSON but not text: the tokenizer refused it with a 500."""
    content = json.dumps({"max_tokens": 2, **body})  # ASCII: the escape goes on the wire
    assert "\\u" in content
    response = httpx.post(
        server.url(path),
        content=content,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{where}: "), error
    assert "unpaired UTF-16 surrogate" in error["message"]


def test_an_unpaired_surrogate_is_a_400_in_anthropics_shape(server: RemoteServer) -> None:
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "\ud800"}]}
    response = httpx.post(
        server.url("/v1/messages"),
        content=json.dumps(body),
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "unpaired UTF-16 surrogate" in error["error"]["message"]


def test_a_paired_surrogate_escape_is_text(server: RemoteServer) -> None:
    content = json.dumps({"prompt": "smile \ud83d\ude00", "max_tokens": 2})
    response = httpx.post(
        server.url(CMPL), content=content, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 200, response.text


def test_the_engine_survives_every_invalid_request(server: RemoteServer) -> None:
    # Runs after the parametrized cases above (same module, file order).
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200
    out = server.client().completions.create(
        model="SmolLM2-135M-Instruct", prompt="hi", max_tokens=2, temperature=0.0
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 2


def test_a_valid_best_of_and_bounded_limits_are_accepted(server: RemoteServer) -> None:
    body = {
        "prompt": "hi",
        "max_tokens": 2,
        "n": 2,
        "best_of": 2,
        "temperature": 0.5,
        "seed": 2**63 - 1,
        "stop": ["s"] * MAX_STOP_STRINGS,
        "logit_bias": {"5": -100, "6": 100},
    }
    response = httpx.post(server.url(CMPL), json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 2


def test_cors_is_off_without_allowed_origins(server: RemoteServer) -> None:
    response = httpx.options(
        server.url(CMPL),
        headers={"Origin": "http://example.test", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in response.headers


def test_a_salted_prefix_is_never_hit_without_the_salt(server: RemoteServer) -> None:
    # 80 tokens: five full blocks that the prefix cache could share.
    prompt = list(range(2000, 2080))

    def hits_after(**extra: Any) -> float:
        before = server.metrics()["kvserve:prefix_cache_hits_total"]
        body = {"prompt": prompt, "max_tokens": 1, **extra}
        assert httpx.post(server.url(CMPL), json=body, timeout=60).status_code == 200
        return server.metrics()["kvserve:prefix_cache_hits_total"] - before

    hits_after(cache_salt="tenant-a")  # fills the cache with salted blocks
    assert hits_after() == 0
    assert hits_after(cache_salt="tenant-b") == 0
    assert hits_after(cache_salt="tenant-a") > 0
