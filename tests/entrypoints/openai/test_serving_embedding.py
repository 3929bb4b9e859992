"""`/v1/embeddings` through the openai client against real `kvserve serve` processes: a tiny
random BERT (checked against sentence-transformers) and SmolLM2 (last-token pooling,
checked against HF's hidden states)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.entrypoints.openai.utils import RemoteServer
from tests.model_executor.tiny_bert import build_tiny_bert
from tests.reference import hf_reference

SENTENCES = ["the quick brown fox", "a cat sat on the mat", "kv cache blocks of keys"]


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, RemoteServer]]:
    directory: Path = tmp_path_factory.mktemp("bert")
    reference = build_tiny_bert(directory, "mean")
    server = RemoteServer(
        str(directory / "st"), "--max-model-len", "128", "--served-model-name", "tiny-bert"
    )
    yield reference, server
    assert server.stop() == 0


def _client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0)


# None: the client's default, which asks for base64 and decodes it itself.
@pytest.mark.parametrize("encoding_format", [None, "float", "base64"])
def test_batched_text_input_matches_sentence_transformers(
    bert: tuple[Any, RemoteServer], encoding_format: str | None
) -> None:
    reference, server = bert
    expected = reference.encode(SENTENCES, normalize_embeddings=True)
    extra = {} if encoding_format is None else {"encoding_format": encoding_format}
    response = _client(server).embeddings.create(model="tiny-bert", input=SENTENCES, **extra)
    assert response.object == "list" and response.model == "tiny-bert"
    assert [d.index for d in response.data] == [0, 1, 2]
    assert all(d.object == "embedding" for d in response.data)
    num_tokens = sum(len(reference.tokenizer(s)["input_ids"]) for s in SENTENCES)
    assert response.usage.prompt_tokens == response.usage.total_tokens == num_tokens
    for data, ref in zip(response.data, expected, strict=True):
        if encoding_format == "base64":  # asked for explicitly, the client leaves it as is
            assert isinstance(data.embedding, str)
            vector = np.frombuffer(base64.b64decode(data.embedding), dtype="<f4")
        else:
            vector = np.asarray(data.embedding, dtype=np.float32)
        assert vector.shape == (64,)
        assert float(vector @ ref) > 0.9999


def test_base64_is_little_endian_float32(bert: tuple[Any, RemoteServer]) -> None:
    """The raw wire format (the openai client decodes it for the test above). The two
    requests are two forwards: under load the thread governor may run them on different
    thread counts, and torch's GEMMs then round the last bits differently (3.5e-5
    relative, seen beside another test worker); a wrong byte order or width is far off."""
    _, server = bert
    body = {"model": "tiny-bert", "input": SENTENCES[0]}
    as_float = httpx.post(server.url("/v1/embeddings"), json=body, timeout=60).json()
    body["encoding_format"] = "base64"
    as_b64 = httpx.post(server.url("/v1/embeddings"), json=body, timeout=60).json()
    decoded = np.frombuffer(base64.b64decode(as_b64["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(
        decoded, np.asarray(as_float["data"][0]["embedding"], "<f4"), rtol=1e-4, atol=1e-6
    )


def test_token_id_input_equals_text_input(bert: tuple[Any, RemoteServer]) -> None:
    reference, server = bert
    client = _client(server)
    ids = [reference.tokenizer(s)["input_ids"] for s in SENTENCES]
    by_text = client.embeddings.create(model="tiny-bert", input=SENTENCES)
    by_ids = client.embeddings.create(model="tiny-bert", input=ids)
    one = client.embeddings.create(model="tiny-bert", input=ids[1])
    for text_data, id_data in zip(by_text.data, by_ids.data, strict=True):
        np.testing.assert_allclose(text_data.embedding, id_data.embedding, atol=1e-6)
    np.testing.assert_allclose(one.data[0].embedding, by_text.data[1].embedding, atol=1e-6)


def test_bad_requests_are_400s_and_the_server_keeps_serving(
    bert: tuple[Any, RemoteServer],
) -> None:
    _, server = bert
    client = _client(server)
    with pytest.raises(openai.BadRequestError, match="input"):
        client.embeddings.create(model="tiny-bert", input=[])
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.embeddings.create(model="tiny-bert", input=[[1, 2, 10**6]])
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model="tiny-bert", input="cat", dimensions=1000)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="cat")
    with pytest.raises(openai.BadRequestError, match="pooling"):
        client.completions.create(model="tiny-bert", prompt="the cat", max_tokens=2)
    short = client.embeddings.create(model="tiny-bert", input="cat", dimensions=8)
    assert len(short.data[0].embedding) == 8
    assert float(np.linalg.norm(short.data[0].embedding)) == pytest.approx(1.0, abs=1e-5)
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200


def test_smollm2_embeddings_match_hf_last_token() -> None:
    server = RemoteServer("--task", "embed", "--served-model-name", "smol-embed")
    try:
        prompts = ["Hello, my name is", "The capital of France is"]
        response = _client(server).embeddings.create(model="smol-embed", input=prompts)
        ref = hf_reference()
        for prompt, data in zip(prompts, response.data, strict=True):
            ids = ref.tokenizer(prompt)["input_ids"]
            with torch.inference_mode():
                hidden = ref.model.model(torch.tensor([ids])).last_hidden_state[0, -1]
            expected = torch.nn.functional.normalize(hidden, dim=-1).numpy()
            assert float(np.asarray(data.embedding, dtype=np.float32) @ expected) > 0.9999
        assert response.usage.prompt_tokens == sum(
            len(ref.tokenizer(p)["input_ids"]) for p in prompts
        )
    finally:
        assert server.stop() == 0
