"""LLM.beam_search against transformers' num_beams search on the same tiny random Llama."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve.entrypoints.llm import LLM
from kvserve.sampling_params import BeamSearchParams
from tests.entrypoints.test_llm_tiny_models import CORPUS, build_model
from tests.reference import assert_no_leak

WIDTH = 4
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, LLM]:
    directory = tmp_path_factory.mktemp("tiny-llama")
    reference = build_model("llama", Path(directory))
    llm = LLM(str(directory), block_size=4, kv_cache_memory=16 << 20)
    yield reference, llm
    llm.llm_engine.shutdown()


@torch.inference_mode()
def hf_beam_search(model: Any, prompt: list[int], length_penalty: float) -> list[int]:
    """HF's num_beams search with EOS ignored: the model has no eos id, so every beam
    runs to max_new_tokens and EOS is scored like any token."""
    from transformers import GenerationConfig

    model.config.eos_token_id = None
    model.generation_config = GenerationConfig(
        num_beams=WIDTH,
        num_return_sequences=1,
        do_sample=False,
        max_new_tokens=MAX_TOKENS,
        length_penalty=length_penalty,
        early_stopping=False,
        pad_token_id=0,
    )
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)))
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("length_penalty", [1.0, 0.6])
def test_best_beam_equals_transformers(tiny: tuple[Any, LLM], length_penalty: float) -> None:
    reference, llm = tiny
    prompts = [llm.get_tokenizer().encode(text) for text in CORPUS[:4]]
    params = BeamSearchParams(
        beam_width=WIDTH, max_tokens=MAX_TOKENS, ignore_eos=True, length_penalty=length_penalty
    )
    # A spy on generate: each step's requests report how much the prefix cache served.
    cached: list[int] = []
    generate = llm.generate

    def spying_generate(*args: Any, **kwargs: Any) -> Any:
        outputs = generate(*args, **kwargs)
        cached.extend(o.num_cached_tokens or 0 for o in outputs)
        return outputs

    llm.generate = spying_generate  # type: ignore[method-assign]
    try:
        outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        del llm.generate
    assert len(outputs) == len(prompts)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert len(output.sequences) == WIDTH
        best = output.sequences[0]
        assert best.tokens[: len(prompt)] == prompt
        assert best.tokens[len(prompt) :] == hf_beam_search(reference, prompt, length_penalty)
        assert best.text == llm.get_tokenizer().decode(best.tokens[len(prompt) :])
        scores = [s.cum_logprob for s in output.sequences]
        assert scores == sorted(scores, reverse=True)
    # Beams re-submit their whole sequence each step; all but the newest block comes
    # from the prefix cache (4 prompts x 4 beams x 11 later steps).
    assert sum(c > 0 for c in cached) >= len(prompts) * WIDTH * (MAX_TOKENS - 2)
    assert_no_leak(llm)


def test_beam_search_params_are_checked(tiny: tuple[Any, LLM]) -> None:
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    _, llm = tiny
    with pytest.raises(ValueError, match="params must be BeamSearchParams"):
        llm.beam_search(["the quick"], {"beam_width": 2})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"beam_width=11 needs 22 logprobs .* max_logprobs=20"):
        llm.beam_search(["the quick"], BeamSearchParams(beam_width=11, max_tokens=2))
    assert_no_leak(llm)
