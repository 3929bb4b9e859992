"""Suffix decoding's proposer: the local (own tokens) and shared (recent outputs) lookups
against plain-loop references, the draft length rules, the shared tree's eviction, and the
per-step cost."""

from __future__ import annotations

import time
from collections import Counter
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvserve.config import SpeculativeConfig
from kvserve.spec_decode.proposer import ProposerInputs
from kvserve.spec_decode.suffix_decoding import (
    SuffixDecodingProposer,
    SuffixTrie,
    speculate_local,
)


def local(tokens: list[int], depth: int = 8, k: int = 8, factor: float = 1.0, p: float = 0.1):
    return speculate_local(np.array(tokens, dtype=np.int32), depth, k, factor, p)


def slow_local(tokens: list[int], depth: int, k: int, factor: float, p: float) -> list[int]:
    """The definition: the longest suffix (<= depth) that occurred earlier with a
    continuation, then the majority continuation of its occurrences while the cumulative
    frequency stays >= p (ties: the smallest token)."""
    n = len(tokens)
    for m in range(min(depth, n - 1), 0, -1):
        ends = [e for e in range(m - 1, n - 1) if tokens[e - m + 1 : e + 1] == tokens[n - m :]]
        if ends:
            break
    else:
        return []
    draft: list[int] = []
    prob = 1.0
    while len(draft) < min(k, int(m * factor + 1e-6)) and ends:
        counts = Counter(tokens[e + 1] for e in ends)
        token, c = min(counts.items(), key=lambda item: (-item[1], item[0]))
        prob *= c / len(ends)
        if prob < p:
            break
        draft.append(token)
        ends = [e + 1 for e in ends if tokens[e + 1] == token and e + 1 < n - 1]
    return draft


def test_local_lookup_equals_a_plain_loop() -> None:
    rng = np.random.default_rng(0)
    for _ in range(400):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 60))).tolist()
        depth, k = int(rng.integers(1, 10)), int(rng.integers(1, 8))
        factor, p = float(rng.choice([0.5, 1.0, 2.0])), float(rng.choice([0.0, 0.3, 0.6]))
        got = local(tokens, depth, k, factor, p).token_ids
        assert got == slow_local(tokens, depth, k, factor, p), (tokens, depth, k, factor, p)


def test_frequency_wins_and_short_matches_draft_little() -> None:
    # After "1 2": 3 twice, 4 once; the majority goes on.
    draft = local([1, 2, 3, 5, 1, 2, 3, 5, 1, 2, 4, 6, 1, 2])
    assert draft.token_ids == [3, 5] and draft.match_len == 2
    assert draft.score == pytest.approx(2 / 3 + 2 / 3)
    # A one-token match drafts at most one token with factor 1, two with factor 2.
    assert local([7, 8, 9, 7], factor=1.0).token_ids == [8]
    assert local([7, 8, 9, 7], factor=2.0).token_ids == [8, 9]
    # min_token_prob stops a draft at an uncertain branch.
    assert local([1, 2, 3, 1, 2, 4, 1, 2], p=0.6).token_ids == []


def test_trie_counts_equal_substring_counts_and_removal_undoes_insertion() -> None:
    rng = np.random.default_rng(1)
    trie = SuffixTrie(max_depth=4)
    seqs = [rng.integers(0, 3, size=int(rng.integers(1, 30))).tolist() for _ in range(6)]
    for seq in seqs:
        frontier: list[Any] = []
        for i in range(0, len(seq), 3):  # grown a few tokens at a time, as steps sample
            frontier = trie.extend(frontier, seq[i : i + 3])

    def count(path: list[int]) -> int:
        node = trie.root
        for token in path:
            if token not in node.children:
                return 0
            node = node.children[token]
        return node.count

    def expected(path: list[int], live: list[list[int]]) -> int:
        m = len(path)
        return sum(s[i : i + m] == path for s in live for i in range(len(s) - m + 1))

    paths = [rng.integers(0, 3, size=int(rng.integers(1, 5))).tolist() for _ in range(100)]
    for path in paths:
        assert count(path) == expected(path, seqs)
    for seq in seqs[:3]:
        trie.remove(seq)
    for path in paths:
        assert count(path) == expected(path, seqs[3:])
    for seq in seqs[3:]:
        trie.remove(seq)
    assert not trie.root.children


def test_trie_speculates_after_the_longest_match() -> None:
    trie = SuffixTrie(max_depth=8)
    trie.extend([], [1, 2, 3, 4, 5, 9, 2, 3, 7])
    # "2 3" occurs twice (then 4, then 7); "1 2 3" once, so the longer match decides.
    assert trie.speculate([1, 2, 3], 8, 1.0, 0.1).token_ids == [4, 5, 9]
    draft = trie.speculate([8, 2, 3], 8, 1.0, 0.1)
    assert draft.match_len == 2 and draft.token_ids == [4, 5]
    assert trie.speculate([8, 2, 3], 8, 1.0, 0.6).token_ids == []
    assert trie.speculate([6], 8, 1.0, 0.1).token_ids == []


def make_proposer(**spec: Any) -> SuffixDecodingProposer:
    config = SimpleNamespace(
        speculative_config=SpeculativeConfig(method="suffix", **spec), max_seq_len=4096
    )
    return SuffixDecodingProposer(config, torch.device("cpu"))  # type: ignore[arg-type]


class Batch:
    """A persistent batch's token rows, grown as a runner would."""

    def __init__(self, rows: int = 4, width: int = 4096) -> None:
        self.token_ids = np.zeros((rows, width), dtype=np.int32)
        self.num_tokens = np.zeros(rows, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(rows, dtype=np.int32)
        self.req_ids: dict[int, str] = {}

    def add(self, row: int, req_id: str, prompt: list[int]) -> None:
        self.req_ids[row] = req_id
        self.token_ids[row, : len(prompt)] = prompt
        self.num_tokens[row] = self.num_prompt_tokens[row] = len(prompt)

    def append(self, row: int, tokens: list[int]) -> None:
        n = int(self.num_tokens[row])
        self.token_ids[row, n : n + len(tokens)] = tokens
        self.num_tokens[row] = n + len(tokens)

    def inputs(self, rows: list[int]) -> ProposerInputs:
        return ProposerInputs(
            rows=np.array(rows, dtype=np.int64),
            req_ids=[self.req_ids[r] for r in rows],
            token_ids=self.token_ids,
            num_tokens=self.num_tokens,
            num_prompt_tokens=self.num_prompt_tokens,
            num_computed_before=self.num_tokens,
        )


def test_finished_outputs_draft_for_later_requests_and_are_evicted() -> None:
    proposer = make_proposer(num_speculative_tokens=8, suffix_decoding_max_cached_requests=1)
    batch = Batch()
    answer = [50, 51, 52, 53, 54, 55, 56, 57]
    batch.add(0, "a", [1, 2, 3])
    for token in answer:  # the answer is sampled one token a step
        batch.append(0, [token])
        proposer.propose(batch.inputs([0]))
    proposer.remove_requests({"a"})
    assert proposer.request_census() == {"suffix_active_requests": 0}
    # A new request whose prompt never held the answer starts it: the shared tree drafts.
    batch.add(1, "b", [9, 9, 50, 51])
    assert proposer.propose(batch.inputs([1])) == [[52, 53]]  # factor 1: match of 2
    batch.append(1, [52, 53, 54])
    assert proposer.propose(batch.inputs([1])) == [[55, 56, 57]]
    # "b" finishes with another output; with one cached request "a"'s output is evicted.
    proposer.remove_requests({"b"})
    batch.add(2, "c", [0, 50, 51, 52, 53])
    assert proposer.propose(batch.inputs([2])) == [[54]]  # "b"'s output: 50..54
    assert list(proposer.cached) == ["b"]


def test_config_defaults_and_errors() -> None:
    spec = SpeculativeConfig(method="suffix")
    assert spec.num_speculative_tokens == spec.suffix_decoding_max_tree_depth == 24
    assert spec.num_lookahead_slots == 0
    for key, value in [
        ("suffix_decoding_max_tree_depth", 0),
        ("suffix_decoding_max_cached_requests", -1),
        ("suffix_decoding_max_spec_factor", 0),
        ("suffix_decoding_min_token_prob", 1.5),
    ]:
        with pytest.raises(ValueError, match=key):
            SpeculativeConfig(method="suffix", **{key: value})


def test_proposing_costs_well_under_a_millisecond() -> None:
    """A 2000-token code-like request (a small vocabulary: many candidate matches) beside a
    shared tree of 200 finished outputs: one propose per request and step."""
    rng = np.random.default_rng(2)
    proposer = make_proposer(num_speculative_tokens=24)
    batch = Batch(rows=8)
    for i in range(200):
        batch.add(0, f"old{i}", [1])
        batch.append(0, rng.integers(0, 300, size=200).tolist())
        proposer.propose(batch.inputs([0]))
        proposer.remove_requests({f"old{i}"})
    base = rng.integers(0, 300, size=400).tolist()
    for row in range(8):
        batch.add(row, f"r{row}", base * 4 + rng.integers(0, 300, size=400).tolist())
    steps = 20
    start = time.perf_counter()
    for _ in range(steps):
        drafts = proposer.propose(batch.inputs(list(range(8))))
        for row, draft in enumerate(drafts):
            batch.append(row, [*draft[:2], int(rng.integers(0, 300))])
    per_request_ms = (time.perf_counter() - start) / (steps * 8) * 1e3
    print(f"suffix propose: {per_request_ms:.3f} ms per request and step")
    assert per_request_ms < 1.0
