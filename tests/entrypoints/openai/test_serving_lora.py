"""LoRA through `kvserve serve` and the openai client: adapters as models (`--lora-modules`
and the dynamic load/unload endpoints), mixed in one batch, token-exact against HF + PEFT."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.entrypoints.openai.utils import RemoteServer
from tests.entrypoints.test_llm_tiny_models import CORPUS, hf_greedy
from tests.lora.adapters import build_base_and_adapters, merged_reference

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    directory: Path = tmp_path_factory.mktemp("lora_server")
    base, paths = build_base_and_adapters(directory)
    server = RemoteServer(
        str(directory / "base"),
        "--served-model-name", "tiny-llama",
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
        "--lora-modules", f"alpha={paths['alpha']}",
    )  # fmt: skip
    references = {"tiny-llama": base}
    references.update({n: merged_reference(directory, p) for n, p in paths.items()})
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory / "base")
    yield {"server": server, "paths": paths, "refs": references, "tokenizer": tokenizer}
    assert server.stop() == 0


def _prompts(setup: dict[str, Any]) -> list[list[int]]:
    return [setup["tokenizer"].encode(text) for text in CORPUS[:3]]


async def _complete(server: RemoteServer, model: str, prompt: list[int]) -> str:
    client = openai.AsyncOpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0)
    response = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert response.usage is not None and response.usage.completion_tokens == MAX_TOKENS
    return response.choices[0].text


def _expected_text(setup: dict[str, Any], model: str, prompt: list[int]) -> str:
    """HF + PEFT's greedy tokens, decoded as the server decodes its own."""
    tokens = hf_greedy(setup["refs"][model], prompt, MAX_TOKENS)
    return str(setup["tokenizer"].decode(tokens, skip_special_tokens=True))


def _post(server: RemoteServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url(path), json=body, timeout=60)


def test_models_lists_the_adapters(setup: dict[str, Any]) -> None:
    client = openai.OpenAI(base_url=setup["server"].url("/v1"), api_key="none")
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny-llama", "alpha"}
    assert cards["alpha"].parent == "tiny-llama"  # type: ignore[attr-defined]


def test_base_and_adapters_in_one_batch_match_merged_hf(setup: dict[str, Any]) -> None:
    server = setup["server"]
    loaded = _post(
        server,
        "/v1/load_lora_adapter",
        {"lora_name": "beta", "lora_path": str(setup["paths"]["beta"])},
    )
    assert loaded.status_code == 200, loaded.text
    prompts = _prompts(setup)
    jobs = [(model, p) for p in prompts for model in ("tiny-llama", "alpha", "beta")]

    async def run_all() -> list[str]:
        return await asyncio.gather(*(_complete(server, m, p) for m, p in jobs))

    results = asyncio.run(run_all())
    for (model, prompt), text in zip(jobs, results, strict=True):
        assert text == _expected_text(setup, model, prompt), model
    assert len(set(results)) == len(jobs)


def test_unload_and_unknown_adapters(setup: dict[str, Any]) -> None:
    server = setup["server"]
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0)
    path = str(setup["paths"]["beta"])
    _post(server, "/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": path})
    assert "gamma" in {m.id for m in client.models.list().data}
    duplicate = _post(server, "/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": path})
    assert duplicate.status_code == 400
    missing = _post(
        server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent"}
    )
    assert (
        missing.status_code == 400 and "adapter_config.json" in missing.json()["error"]["message"]
    )

    removed = _post(server, "/v1/unload_lora_adapter", {"lora_name": "gamma"})
    assert removed.status_code == 200, removed.text
    assert "gamma" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gamma", prompt="the fox", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="no-such-adapter", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    again = _post(server, "/v1/unload_lora_adapter", {"lora_name": "gamma"})
    assert again.status_code == 404
    # The server keeps serving, base model and adapters alike.
    prompt = _prompts(setup)[0]
    text = asyncio.run(_complete(server, "alpha", prompt))
    assert text == _expected_text(setup, "alpha", prompt)
    assert client.completions.create(model="tiny-llama", prompt="the fox", max_tokens=2).choices
