"""Prompt lookup: the longest (then latest) earlier match of the suffix, and what followed."""

from __future__ import annotations

import numpy as np
import pytest

from kvserve.config import SpeculativeConfig
from kvserve.spec_decode.ngram_proposer import find_ngram_draft


def draft(tokens: list[int], min_n: int = 1, max_n: int = 4, k: int = 3) -> list[int]:
    return find_ngram_draft(np.array(tokens, dtype=np.int32), min_n, max_n, k)


def test_the_longest_match_wins_then_the_latest() -> None:
    #        0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 8, 2, 3, 7, 6, 5, 2, 3]
    # Suffix [2, 3] occurs at 1-2 and 5-6; [1, 2, 3]... no; the latest of equal length wins.
    assert draft(tokens) == [7, 6, 5]
    # A longer match beats a later one: [5, 1, 2] matches at 0-2 only with length 3.
    assert draft([5, 1, 2, 4, 4, 2, 9, 5, 1, 2]) == [4, 4, 2]


def test_min_n_k_and_the_end_of_the_sequence() -> None:
    assert draft([1, 2, 3, 4], min_n=1) == []  # the last token never occurred before
    assert draft([1, 2, 3, 1, 2], min_n=3) == []  # only a 2-token match
    assert draft([1, 2, 3, 1, 2], min_n=2) == [3, 1, 2]
    assert draft([1, 2, 3, 1, 2], min_n=2, k=1) == [3]
    assert draft([4, 4, 4], min_n=1, k=5) == [4]  # the match right before the end


def test_vectorised_search_equals_a_plain_loop() -> None:
    rng = np.random.default_rng(0)

    def slow(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
        for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + k]
        return []

    for _ in range(300):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 40))).tolist()
        assert draft(tokens, 2, 5, 4) == slow(tokens, 2, 5, 4)


def test_config_defaults_and_errors() -> None:
    spec = SpeculativeConfig(model="ngram", num_speculative_tokens=4)
    assert spec.method == "ngram"
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (2, 5)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(method="ngram")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=4,
                          prompt_lookup_max=3)  # fmt: skip
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="eagle", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="unknown key"):
        SpeculativeConfig.from_cli('{"method": "ngram", "num_spec": 2}')
