"""Session fixtures for the packaged Gemma 3 270M (hybrid sliding-window + global layers).

Loaded once per test session and shared by every test that needs it: an engine factory
(one LLM per distinct configuration), the 7-prompt set (two prompts longer than the
512-token window, ~1,200 and ~2,000 tokens) and the HF transformers reference tokens,
computed once from transformers' own GGUF loader in float32.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine_cache import EngineCache, engine_cache
from tests.reference import _TokenStore, hf_float32_model, on_one_thread

GEMMA3 = "gemma-3-270m"
# HF's float32 decode reads the whole model (262k x 640 tied head included, ~1 GB) per
# token: each reference token costs more than the engine's, so 16, not more.
GEMMA3_MAX_TOKENS = 16
GEMMA3_WINDOW = 512
GEMMA3_KV_CACHE_MEMORY = 256 << 20

_SHORT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The three primary colors are",
    "Photosynthesis is the process by which green plants use sunlight to",
]


def _long_text(num_items: int) -> str:
    # Varied, non-repeating facts, so attention beyond the window actually matters.
    facts = " ".join(
        f"Item {i}: the {['red', 'green', 'blue', 'amber', 'violet'][i % 5]} box on shelf "
        f"{i % 7} holds {i * 3 % 11} apples and {i * 5 % 13} pears; it was checked on day "
        f"{i * 7 % 31} by {['Ann', 'Bo', 'Cy', 'Di'][i % 4]}."
        for i in range(1, num_items + 1)
    )
    return (
        f"Inventory log.\n{facts}\nQuestion: which shelf holds item 3? Answer: item 3 is on shelf"
    )


@pytest.fixture(scope="session")
def gemma3_llm_factory() -> Iterator[EngineCache]:
    """Builds LLMs for Gemma 3 270M, one per distinct configuration (see EngineCache)."""
    yield from engine_cache(model=GEMMA3, kv_cache_memory=GEMMA3_KV_CACHE_MEMORY)


@pytest.fixture(scope="session")
def gemma3_llm(gemma3_llm_factory: EngineCache) -> Any:
    """Chunked prefill with a 64-token budget, so long prompts cross the window in steps."""
    return gemma3_llm_factory.pin(max_num_batched_tokens=64, enable_prefix_caching=True)


@pytest.fixture(scope="session")
def gemma3_prompts(gemma3_llm: Any) -> list[list[int]]:
    """7 prompts as token ids (BOS included): 5 short, 2 of ~1,200 and ~2,000 (beyond two
    and four windows)."""
    tokenizer = gemma3_llm.get_tokenizer()
    texts = [*_SHORT_PROMPTS, _long_text(38), _long_text(64)]
    prompts = [list(tokenizer.encode(text)) for text in texts]
    lengths = [len(p) for p in prompts]
    assert sum(n > 2 * GEMMA3_WINDOW for n in lengths) == 2 and max(lengths) <= 2100, lengths
    return prompts


class Gemma3HFReference:
    """Greedy tokens from transformers' Gemma3ForCausalLM on the same GGUF, float32.

    Results come from the same on-disk store as SmolLM2's reference (tests/reference.py's
    ``_TokenStore``, keyed on this GGUF file, the library versions and this file's code):
    the model (~1 GB in float32, dequantized from the GGUF) is loaded only when an entry
    is missing, as in a first run; later runs and the other xdist worker read the tokens."""

    def __init__(self) -> None:
        from kvserve.transformers_utils.model_resolver import resolve_model

        self.gguf = Path(resolve_model(GEMMA3).path)
        self._store = _TokenStore(self.gguf)
        # Prompt -> its longest greedy run so far: a shorter run is that run's prefix (the
        # same forward calls up to its end), so no prompt is prefilled twice.
        self._runs: dict[tuple[int, ...], list[int]] = {}

    @functools.cached_property
    def model(self) -> Any:
        model = hf_float32_model(self.gguf)
        # One intra-op thread, as SmolLM2's reference (tests/reference.py says why): under
        # `pytest -n 2` the other worker keeps the second core busy.
        on_one_thread(model)
        return model

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """Exactly max_tokens argmax tokens (EOS does not stop it, like ignore_eos=True)."""
        return self._store.get_or_compute(
            __file__,
            {"greedy": prompt_ids, "max_tokens": max_tokens},
            lambda: self._compute_greedy(prompt_ids, max_tokens),
        )

    @torch.inference_mode()
    def _compute_greedy(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        key = tuple(prompt_ids)
        if len(self._runs.get(key, ())) < max_tokens:
            # logits_to_keep=1: the prompt's other rows would each be a 262k-wide matmul
            # (a 3,000-token prompt: ~500 GFLOP nobody reads).
            out = self.model(torch.tensor([prompt_ids]), use_cache=True, logits_to_keep=1)
            past, tokens = out.past_key_values, [int(out.logits[0, -1].argmax())]
            while len(tokens) < max_tokens:
                out = self.model(torch.tensor([tokens[-1:]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                tokens.append(int(out.logits[0, -1].argmax()))
            self._runs[key] = tokens
        return self._runs[key][:max_tokens]


@pytest.fixture(scope="session")
def gemma3_hf() -> Iterator[Gemma3HFReference]:
    reference = Gemma3HFReference()
    yield reference
    if "model" in vars(reference):  # loaded: a store entry was missing
        del reference.model
        gc.collect()


@pytest.fixture(scope="session")
def gemma3_reference(
    gemma3_hf: Gemma3HFReference, gemma3_prompts: list[list[int]]
) -> list[list[int]]:
    """HF's GEMMA3_MAX_TOKENS greedy tokens for each of ``gemma3_prompts``."""
    return [gemma3_hf.greedy(p, GEMMA3_MAX_TOKENS) for p in gemma3_prompts]
