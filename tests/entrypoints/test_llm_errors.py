"""Bad input raises a ValueError naming the problem; the same engine keeps working."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvserve.entrypoints.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.reference import assert_no_leak

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("make_call", "message"),
    [
        (lambda llm: llm.generate("", use_tqdm=False), "empty"),
        (lambda llm: llm.generate({"prompt_token_ids": []}, use_tqdm=False), "empty"),
        (
            lambda llm: llm.generate({"prompt_token_ids": [5] * 9000}, use_tqdm=False),
            "maximum model length",
        ),
        (lambda llm: llm.generate({"prompt_token_ids": [10**7]}, use_tqdm=False), "vocab"),
        (lambda llm: llm.generate("hi", SamplingParams(max_tokens=0)), "max_tokens"),
        (lambda llm: llm.generate("hi", SamplingParams(temperature=-1.0)), "temperature"),
        (lambda llm: llm.generate("hi", SamplingParams(top_p=0.0)), "top_p"),
        (lambda llm: llm.generate("hi", SamplingParams(top_p=1.5)), "top_p"),
        (lambda llm: llm.generate(["ok", ""], use_tqdm=False), "empty"),
        (lambda llm: llm.generate("hi", priority=[1], use_tqdm=False), "priority"),
        (lambda llm: llm.chat([{"content": "no role"}], use_tqdm=False), "role"),
        # A lone surrogate is a legal str but not text: the tokenizer would raise a TypeError.
        (lambda llm: llm.generate("a\ud800b", use_tqdm=False), "prompt holds an unpaired"),
        (
            lambda llm: llm.chat([{"role": "user", "content": "\udc00"}], use_tqdm=False),
            r"messages\.0\.content holds an unpaired",
        ),
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(llm: Any, make_call: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_call(llm)
    assert_no_leak(llm)
    out = llm.generate(
        "The capital of France is", SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 4
    assert_no_leak(llm)


def test_unknown_model_path() -> None:
    with pytest.raises(ValueError, match="does-not-exist"):
        LLM("/nonexistent/does-not-exist")


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    path = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="gpt2"):
        LLM(str(path))


def test_bad_engine_arguments() -> None:
    with pytest.raises(ValueError, match="block_size"):
        LLM(block_size=3)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(max_model_len=10**9)
    with pytest.raises(ValueError, match="not_an_arg"):
        LLM(not_an_arg=1)
