"""`kvserve serve --skip-tokenizer-init` on a checkpoint without a tokenizer: token-id
prompts are served (no text comes back); text prompts and chat get a 400 naming why."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.entrypoints.openai.utils import RemoteServer
from tests.family_models import build_family_model


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    model_dir = tmp_path_factory.mktemp("qwen3_no_tokenizer")
    build_family_model("qwen3", model_dir)
    assert not list(model_dir.glob("tokenizer*"))
    remote = RemoteServer(str(model_dir), "--skip-tokenizer-init")
    yield remote
    remote.stop()


def test_token_id_prompt_is_served_without_text(server: RemoteServer) -> None:
    client = server.client()
    completion = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=[5, 17, 42, 9, 88],
        max_tokens=6,
        temperature=0.0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert completion.usage is not None and completion.usage.completion_tokens == 6
    assert completion.choices[0].text == ""
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and len(logprobs.token_logprobs or []) == 6


def test_text_prompt_and_chat_are_refused(server: RemoteServer) -> None:
    client = server.client()
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="skip-tokenizer-init"):
        client.completions.create(model=model, prompt="hello", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="tokenizer"):
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert server.client().models.list().data  # still serving
