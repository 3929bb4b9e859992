"""Benchmark datasets: deterministic per seed, the lengths asked for, prefixes really shared."""

from __future__ import annotations

from typing import Any

import pytest

from kvserve.benchmarks.datasets import (
    sample_multi_turn_conversations,
    sample_random_requests,
    sample_shared_prefix_requests,
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from kvserve.transformers_utils.model_resolver import resolve_model
    from kvserve.transformers_utils.tokenizer import get_tokenizer

    return get_tokenizer(resolve_model(None))


def test_random_requests_are_seeded_and_in_range(tokenizer: Any) -> None:
    a = sample_random_requests(tokenizer, 16, input_len=40, output_len=10, range_ratio=0.5, seed=3)
    b = sample_random_requests(tokenizer, 16, input_len=40, output_len=10, range_ratio=0.5, seed=3)
    c = sample_random_requests(tokenizer, 16, input_len=40, output_len=10, range_ratio=0.5, seed=4)
    assert [r.prompt for r in a] == [r.prompt for r in b] != [r.prompt for r in c]
    for r in a:
        assert 5 <= r.expected_output_len <= 15
        assert (
            r.prompt_len
            == len(r.prompt_token_ids)
            == len(tokenizer.encode(r.prompt, add_special_tokens=False))
        )
        # Decoding random ids and re-encoding merges a few of them at most.
        assert 10 <= r.prompt_len <= 70
        assert not set(r.prompt_token_ids) & set(tokenizer.all_special_ids)
    assert len({r.prompt_len for r in a}) > 1  # the range ratio spreads the lengths


def test_shared_prefix_requests_share_their_group_prefix(tokenizer: Any) -> None:
    reqs = sample_shared_prefix_requests(
        tokenizer, 12, prefix_len=32, suffix_len=8, output_len=4, num_prefixes=3, seed=0
    )
    assert len(reqs) == 12
    heads = [tuple(r.prompt_token_ids[:24]) for r in reqs]
    # Three groups of four; a little slack at the end for BPE merges at the boundary.
    assert sorted(heads.count(h) for h in set(heads)) == [4, 4, 4]


def test_multi_turn_conversations(tokenizer: Any) -> None:
    convs = sample_multi_turn_conversations(
        tokenizer, 3, num_turns=4, input_len=10, output_len=5, seed=1
    )
    assert len(convs) == 3 and all(len(c.user_turns) == 4 for c in convs)
    assert len({t for c in convs for t in c.user_turns}) == 12
    with pytest.raises(ValueError, match="num_turns"):
        sample_multi_turn_conversations(tokenizer, 1, num_turns=0, input_len=4, output_len=1)
