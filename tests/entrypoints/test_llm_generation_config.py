"""The model's generation_config.json supplies LLM's default sampling parameters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvserve.entrypoints.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.entrypoints.test_llm_tiny_models import CORPUS, build_model, hf_greedy

MAX_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    directory = Path(tmp_path_factory.mktemp("tiny-generation-config"))
    reference = build_model("llama", directory)
    path = directory / "generation_config.json"
    saved = json.loads(path.read_text())
    # top_k=1 makes the defaults observable: sampling with them is greedy decoding.
    saved.update(temperature=0.7, top_k=1, max_new_tokens=MAX_NEW_TOKENS)
    path.write_text(json.dumps(saved))
    return directory, reference


def test_generation_config_supplies_the_defaults(tiny_dir: tuple[Path, Any]) -> None:
    directory, reference = tiny_dir
    llm = LLM(str(directory), kv_cache_memory=8 << 20, block_size=4)
    try:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (
            0.7,
            1,
            MAX_NEW_TOKENS,
        )
        prompts = [llm.get_tokenizer().encode(text) for text in CORPUS[:4]]
        token_prompts: list[Any] = [{"prompt_token_ids": p} for p in prompts]
        eos = llm.get_tokenizer().eos_token_id
        for prompt, output in zip(
            prompts, llm.generate(token_prompts, use_tqdm=False), strict=True
        ):
            tokens = list(output.outputs[0].token_ids)
            greedy = hf_greedy(reference, prompt, MAX_NEW_TOKENS)
            assert tokens == greedy[: len(tokens)]
            assert len(tokens) == MAX_NEW_TOKENS or tokens[-1] == eos
        # Parameters the caller passes replace the defaults, as in vLLM: top_k=0 samples
        # the whole distribution (seeded), which leaves the greedy path somewhere.
        free = SamplingParams(temperature=1.0, seed=1, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        sampled = llm.generate(token_prompts, free, use_tqdm=False)
        assert any(
            list(o.outputs[0].token_ids) != hf_greedy(reference, p, MAX_NEW_TOKENS)
            for p, o in zip(prompts, sampled, strict=True)
        )
    finally:
        llm.llm_engine.shutdown()


def test_generation_config_vllm_ignores_the_model_file(tiny_dir: tuple[Path, Any]) -> None:
    directory, _ = tiny_dir
    llm = LLM(
        str(directory),
        kv_cache_memory=8 << 20,
        generation_config="vllm",
        override_generation_config={"top_p": 0.5},
    )
    try:
        assert llm.get_default_sampling_params() == SamplingParams(top_p=0.5)
    finally:
        llm.llm_engine.shutdown()
