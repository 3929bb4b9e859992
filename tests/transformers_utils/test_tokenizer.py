from __future__ import annotations

import pytest

from kvserve.transformers_utils.model_resolver import resolve_model
from kvserve.transformers_utils.tokenizer import get_tokenizer


def test_gguf_tokenizer_is_cached_and_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    resolved = resolve_model(None)
    tokenizer = get_tokenizer(resolved)
    assert get_tokenizer(resolve_model("SmolLM2-135M-Instruct")) is tokenizer
    ids = tokenizer("Hello world").input_ids
    assert tokenizer.decode(ids) == "Hello world"
    assert tokenizer.eos_token == "<|im_end|>"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>" in chat
