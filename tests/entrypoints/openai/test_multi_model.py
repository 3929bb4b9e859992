"""Several models on one server: SmolLM2 (GGUF) and a tiny random Llama (HF directory),
found by --models-dir, at most one loaded at a time (--max-loaded-models 1).

The tests share one server and run in order: each leaves the loaded model as the next
expects (SmolLM2 at start, SmolLM2 after the switch test, whatever after the kill test).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from kvserve.entrypoints.openai.cli_args import add_serve_args
from kvserve.entrypoints.openai.model_sources import model_sources
from kvserve.transformers_utils.model_resolver import resolve_model
from tests.entrypoints.openai.utils import RemoteServer
from tests.entrypoints.test_llm_tiny_models import build_model, hf_greedy

pytestmark = pytest.mark.slow

SMOL = "smollm2"
TINY = "tiny-llama"
PROMPT = "The capital of France is"
TINY_PROMPT = [5, 17, 42, 99, 7, 250]
N = 10


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """The folder --models-dir scans, and the tiny model's transformers reference."""
    folder = tmp_path_factory.mktemp("models")
    os.symlink(resolve_model(None).path, folder / f"{SMOL}.gguf")
    reference = build_model("llama", folder / TINY)
    (folder / "notes.txt").write_text("not a model: skipped")
    return folder, reference


@pytest.fixture(scope="module")
def multi_server(models_dir: tuple[Path, Any]) -> Iterator[RemoteServer]:
    remote = RemoteServer("--models-dir", str(models_dir[0]), "--max-loaded-models", "1")
    yield remote
    assert remote.stop() == 0


def _statuses(remote: RemoteServer) -> dict[str, str]:
    cards = httpx.get(remote.url("/v1/models"), timeout=10).json()["data"]
    return {card["id"]: card["status"] for card in cards}


def _greedy(client: openai.OpenAI, model: str, prompt: str | list[int]) -> tuple[str, list[str]]:
    out = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=N,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    choice = out.choices[0]
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    return choice.text, choice.logprobs.tokens


def _tree_rss(remote: RemoteServer) -> int:
    root = psutil.Process(remote.proc.pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


def _tiny_expected(models_dir: tuple[Path, Any]) -> tuple[str, list[str]]:
    """The tiny model's greedy text and tokens, by transformers."""
    from transformers import AutoTokenizer

    folder, reference = models_dir
    tokenizer = AutoTokenizer.from_pretrained(folder / TINY)
    ids = hf_greedy(reference, TINY_PROMPT, N)
    return tokenizer.decode(ids), [tokenizer.decode([t]) for t in ids]


def test_models_dir_lists_every_model_with_its_status(multi_server: RemoteServer) -> None:
    # Sorted by name, the first (SmolLM2) loaded at start; the text file is no model.
    assert _statuses(multi_server) == {SMOL: "loaded", TINY: "unloaded"}
    listed = multi_server.client().models.list()
    assert [m.id for m in listed.data] == [SMOL, TINY]


def test_an_unknown_model_is_a_404(multi_server: RemoteServer) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        multi_server.client().completions.create(model="gpt-4", prompt="hi", max_tokens=1)
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == "model", error
    assert _statuses(multi_server)[SMOL] == "loaded"  # nothing was loaded or unloaded


def test_each_model_answers_with_its_tokens_and_the_lru_one_is_unloaded(
    multi_server: RemoteServer, server: RemoteServer, models_dir: tuple[Path, Any]
) -> None:
    client = multi_server.client(timeout=300)
    # SmolLM2 here gives the single-model server's tokens.
    smol = _greedy(client, SMOL, PROMPT)
    assert smol == _greedy(server.client(), "SmolLM2-135M-Instruct", PROMPT)
    smol_core = multi_server.engine_core_process()
    tree_with_smol = _tree_rss(multi_server)

    # The tiny model loads on its first request; SmolLM2, least recently used, goes.
    assert _greedy(client, TINY, TINY_PROMPT) == _tiny_expected(models_dir)
    assert not psutil.pid_exists(smol_core.pid), "SmolLM2's engine core still runs"
    tiny_core = multi_server.engine_core_process()
    assert _statuses(multi_server) == {SMOL: "unloaded", TINY: "loaded"}
    # Both loaded would be the tree before plus the tiny model's core; SmolLM2's core
    # took its memory with it.
    assert _tree_rss(multi_server) < tree_with_smol + tiny_core.memory_info().rss

    # And back: SmolLM2 loads again and answers as before.
    assert _greedy(client, SMOL, PROMPT) == smol
    assert not psutil.pid_exists(tiny_core.pid)
    assert _statuses(multi_server) == {SMOL: "loaded", TINY: "unloaded"}


def _wait_unloaded(remote: RemoteServer, model: str) -> None:
    deadline = time.monotonic() + 60
    while _statuses(remote)[model] != "unloaded":
        assert time.monotonic() < deadline, f"{model} still listed as loaded after its core died"
        time.sleep(0.1)


def test_a_dead_engine_unloads_its_model_and_the_server_serves_on(
    multi_server: RemoteServer, models_dir: tuple[Path, Any]
) -> None:
    client = multi_server.client(timeout=300)
    expected = _tiny_expected(models_dir)
    multi_server.engine_core_process().kill()  # SmolLM2's
    _wait_unloaded(multi_server, SMOL)
    assert httpx.get(multi_server.url("/health"), timeout=10).status_code == 200
    assert _greedy(client, TINY, TINY_PROMPT) == expected
    # The tiny model's core dies too; its next request loads it again.
    multi_server.engine_core_process().kill()
    _wait_unloaded(multi_server, TINY)
    assert _greedy(client, TINY, TINY_PROMPT) == expected
    assert multi_server.proc.poll() is None


def _parse(*argv: str) -> argparse.Namespace:
    return add_serve_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_model_flags_name_the_models_in_order(models_dir: tuple[Path, Any]) -> None:
    folder = models_dir[0]
    gguf, tiny = str(folder / f"{SMOL}.gguf"), str(folder / TINY)
    sources = model_sources(_parse(gguf, "--model", tiny))
    assert [(s.name, s.engine_args.model) for s in sources] == [(SMOL, gguf), (TINY, tiny)]
    assert [s.name for s in model_sources(_parse("--model", tiny, "--model", gguf))] == [
        TINY,
        SMOL,
    ]
    # One model keeps --served-model-name; several are named by their stems.
    assert [s.name for s in model_sources(_parse(gguf, "--served-model-name", "x"))] == ["x"]
    assert [s.name for s in model_sources(_parse())] == ["SmolLM2-135M-Instruct"]
    with pytest.raises(ValueError, match="served-model-name"):
        model_sources(_parse(gguf, "--model", tiny, "--served-model-name", "x"))
    with pytest.raises(ValueError, match="two models are named"):
        model_sources(_parse(gguf, "--models-dir", str(folder)))
