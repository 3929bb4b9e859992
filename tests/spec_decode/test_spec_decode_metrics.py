"""Acceptance metrics offline (LLM.get_metrics, vLLM's reader): a prompt that repeats
itself is mostly accepted, random tokens mostly rejected."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from kvserve.metrics.reader import Counter, Vector
from kvserve.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})


def spec_counters(llm: Any) -> dict[str, Any]:
    return {
        m.name.removeprefix("kvserve:"): m.value if isinstance(m, Counter) else m.values
        for m in llm.get_metrics()
        if m.name.startswith("kvserve:spec_decode") and isinstance(m, Counter | Vector)
    }


def acceptance(
    llm: Any, prompt_ids: list[int], params: SamplingParams
) -> tuple[float, dict[str, Any]]:
    before = spec_counters(llm)
    llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)
    after = spec_counters(llm)
    drafted = after["spec_decode_num_draft_tokens"] - before.get("spec_decode_num_draft_tokens", 0)
    accepted = after["spec_decode_num_accepted_tokens"] - before.get(
        "spec_decode_num_accepted_tokens", 0
    )
    return (accepted / drafted if drafted else 0.0), after


def test_repeats_are_accepted_and_random_tokens_are_not(llm_factory: Any) -> None:
    llm = llm_factory(speculative_config=NGRAM, disable_log_stats=False)
    tokenizer = llm.get_tokenizer()
    repeating = tokenizer.encode("alpha beta gamma delta epsilon zeta eta theta. " * 8)
    rng = random.Random(0)
    # Random tokens over a small alphabet: every token recurs, so lookup always drafts.
    alphabet = [rng.randrange(1000, 40000) for _ in range(40)]
    noise = [rng.choice(alphabet) for _ in range(300)]

    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    high, after = acceptance(llm, list(repeating), greedy)
    # Random tokens in, tokens sampled from the same alphabet out (greedy would fall into
    # a loop, which n-gram lookup predicts well): every token recurs, so lookup drafts at
    # every step, and the drafts copied from the prompt are mostly wrong.
    sampled = SamplingParams(
        temperature=1.5, max_tokens=40, ignore_eos=True, seed=0, allowed_token_ids=alphabet
    )
    low, after_low = acceptance(llm, noise, sampled)
    assert after_low["spec_decode_num_draft_tokens"] > after["spec_decode_num_draft_tokens"]
    assert high > 0.7, high
    assert low < 0.5, low
    assert high > 1.5 * low
    # vLLM's names, per-position acceptance as one Vector of num_speculative_tokens counts.
    assert after["spec_decode_num_drafts"] > 0
    per_pos = after["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == 4 and sum(per_pos) == after["spec_decode_num_accepted_tokens"]
    assert per_pos == sorted(per_pos, reverse=True)  # a later position needs the earlier


def test_get_metrics_needs_stats(llm: Any) -> None:
    with pytest.raises(RuntimeError, match="disable_log_stats=False"):
        llm.get_metrics()
