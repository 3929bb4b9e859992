"""The official openai client against a real server: completions and chat, whole and streamed."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.entrypoints.openai.utils import RemoteServer

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
MESSAGES: list[Any] = [{"role": "user", "content": "Name three colors."}]


def test_models_version_health(server: RemoteServer) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server.url("/version")).json()["version"]
    assert httpx.get(server.url("/health")).status_code == 200


def test_completion_stream_equals_whole_and_usage_is_exact(
    server: RemoteServer, tokenizer: Any
) -> None:
    client = server.client()
    whole = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1
    )
    choice = whole.choices[0]
    assert whole.object == "text_completion" and choice.text
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert whole.usage.completion_tokens == len(choice.logprobs.tokens) <= 8
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    # include_usage: one last chunk without choices carries the same usage.
    assert not chunks[-1].choices and chunks[-1].usage == whole.usage


def test_chat_stream_equals_whole_and_usage_is_exact(server: RemoteServer, tokenizer: Any) -> None:
    client = server.client()
    whole = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True
    )
    choice = whole.choices[0]
    assert whole.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.message.content
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt_ids, list):  # transformers 5 returns a BatchEncoding
        prompt_ids = prompt_ids["input_ids"]
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == len(prompt_ids)
    assert whole.usage.completion_tokens == len(choice.logprobs.content) <= 6

    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].usage == whole.usage


def test_n_returns_that_many_choices(server: RemoteServer) -> None:
    client = server.client()
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, n=2, temperature=1.0, seed=7, logprobs=True
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert all(c.message.content for c in chat.choices)
    assert chat.usage is not None
    assert chat.usage.completion_tokens == sum(len(c.logprobs.content) for c in chat.choices)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=3, n=2, temperature=0, stream=True
        )
    )
    texts = [
        "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(2)
    ]
    assert texts[0] and texts[0] == texts[1]  # greedy: both samples agree


def test_logprobs_shapes(server: RemoteServer) -> None:
    client = server.client()
    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3
    )
    lp = completion.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert "".join(lp.tokens) == completion.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and 3 <= len(top) <= 4
        assert top[token] == logprob == max(top.values())  # greedy picks the best

    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == entry.logprob >= entry.top_logprobs[1].logprob
        assert bytes(entry.bytes) == entry.token.encode()
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_stop_and_extras(server: RemoteServer) -> None:
    client = server.client()
    # ignore_eos + min_tokens (vLLM extras) force the exact length.
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True, "min_tokens": 6, "top_k": 5, "repetition_penalty": 1.1},
    )
    assert out.usage is not None and out.usage.completion_tokens == 6
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    word = full.choices[0].text.split()[1]
    stopped = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[word]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == full.choices[0].text[: full.choices[0].text.index(word)]


def test_request_id_header_is_echoed(server: RemoteServer) -> None:
    response = httpx.post(
        server.url("/v1/completions"),
        headers={"X-Request-Id": "my-id-42"},
        json={"prompt": PROMPT, "max_tokens": 2},
        timeout=60,
    )
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "my-id-42"
    assert "my-id-42" in response.json()["id"]


def test_tokenize_detokenize(server: RemoteServer, tokenizer: Any) -> None:
    body = httpx.post(server.url("/tokenize"), json={"prompt": PROMPT}).json()
    assert body["tokens"] == tokenizer.encode(PROMPT) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512
    text = httpx.post(server.url("/detokenize"), json={"tokens": body["tokens"]}).json()
    assert text["prompt"] == tokenizer.decode(body["tokens"])
    chat = httpx.post(server.url("/tokenize"), json={"messages": MESSAGES}).json()
    usage = (
        server.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1).usage
    )
    assert usage is not None and chat["count"] == usage.prompt_tokens
