"""Suffix decoding (vLLM's ``suffix`` method, after Arctic Inference's SuffixDecoding):
model-free drafts from the request's own prompt and output and from recent requests'
outputs, for agentic and code-editing loops that repeat what they have seen.

Each step the sequence's suffix (its last ``max_tree_depth`` tokens at most) is matched in
two places, and the draft with the higher score (its expected accepted length: the sum of
the draft tokens' cumulative probabilities) wins:

- locally, over the request's own tokens in the persistent batch (a vectorised numpy
  search, as prompt lookup). It keeps no state, so preemption and recompute cannot stale it.
- globally, in a depth-bounded suffix trie over the outputs of the active requests and of
  the last ``max_cached_requests`` finished ones, grown as tokens are sampled.

From the longest match the draft follows the most frequent continuation, one token at a
time, while the product of the continuation frequencies stays at least ``min_token_prob``;
it is at most ``max_spec_factor`` times the match length (short, unreliable matches draft
little) and at most ``num_speculative_tokens`` long. The target verifies every draft, so
greedy output is the non-speculative engine's.

The arctic-inference package holds a C++ tree, but PyPI has only its sdist (CUDA build);
this is the same structure in Python, costing tens of microseconds per request and step.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvserve.spec_decode.proposer import Proposer, ProposerInputs

if TYPE_CHECKING:
    import torch

    from kvserve.config import EngineConfig


@dataclass
class SuffixDraft:
    token_ids: list[int]
    score: float  # the expected number of accepted tokens
    match_len: int


EMPTY_DRAFT = SuffixDraft([], 0.0, 0)


class _Node:
    """A trie node: how often its path occurred (as a substring of depth <= max_depth)."""

    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    """Every substring of at most ``max_depth`` tokens of the inserted sequences, with its
    number of occurrences. Sequences grow token by token: appending one extends the (at
    most max_depth) suffixes that end at the sequence's last token."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node()

    def extend(self, frontier: list[_Node], tokens: list[int]) -> list[_Node]:
        """Appends ``tokens`` to a sequence whose suffix nodes (longest last, at most
        max_depth - 1) are ``frontier``; returns the new frontier."""
        root, keep = self.root, self.max_depth - 1
        for token in tokens:
            new = []
            for node in (root, *frontier):
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += 1
                new.append(child)
            frontier = new[:keep]
        return frontier

    def remove(self, tokens: list[int]) -> None:
        """Undoes the insertion of a whole sequence (the paths ``extend`` counted)."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start : start + self.max_depth]:
                child = node.children[token]
                child.count -= 1
                if not child.count:
                    # Every path below passes through it, from this same start only.
                    del node.children[token]
                    break
                node = child

    def speculate(
        self, pattern: list[int], max_spec: int, max_spec_factor: float, min_token_prob: float
    ) -> SuffixDraft:
        """Draft after the longest suffix of ``pattern`` found in the trie."""
        root = self.root
        if not pattern or pattern[-1] not in root.children:
            return EMPTY_DRAFT
        for start in range(len(pattern)):
            node: _Node | None = root
            for token in pattern[start:]:
                assert node is not None
                node = node.children.get(token)
                if node is None:
                    break
            if node is not None:
                match_len = len(pattern) - start
                break
        else:  # unreachable: the last token alone matches
            return EMPTY_DRAFT
        limit = min(max_spec, int(match_len * max_spec_factor + 1e-6))
        draft: list[int] = []
        prob, score = 1.0, 0.0
        while len(draft) < limit and node.children:
            token, child = max(node.children.items(), key=lambda item: item[1].count)
            prob *= child.count / node.count
            if prob < min_token_prob:
                break
            draft.append(token)
            score += prob
            node = child
        return SuffixDraft(draft, score, match_len)


def speculate_local(
    tokens: np.ndarray,
    max_depth: int,
    max_spec: int,
    max_spec_factor: float,
    min_token_prob: float,
) -> SuffixDraft:
    """The draft from the sequence itself: the earlier occurrences of its longest suffix
    (up to max_depth tokens) and, among them, the most frequent continuation."""
    n = len(tokens)
    if n < 2:
        return EMPTY_DRAFT
    ends = np.flatnonzero(tokens[: n - 1] == tokens[n - 1])
    if not len(ends):
        return EMPTY_DRAFT
    # Extend every candidate backwards at once; the survivors of the longest are kept.
    match_len = 1
    for offset in range(1, max_depth):
        starts = ends - offset
        alive = starts >= 0
        alive[alive] = tokens[starts[alive]] == tokens[n - 1 - offset]
        if not alive.any():
            break
        ends = ends[alive]
        match_len += 1
    limit = min(max_spec, int(match_len * max_spec_factor + 1e-6))
    draft: list[int] = []
    prob, score = 1.0, 0.0
    while len(draft) < limit and len(ends):
        if len(ends) == 1:  # one occurrence: the rest follows with the same probability
            if prob < min_token_prob:
                break
            end = int(ends[0])
            rest = tokens[end + 1 : end + 1 + limit - len(draft)].tolist()
            draft += rest
            score += prob * len(rest)
            break
        nxt = tokens[ends + 1]
        values, counts = np.unique(nxt, return_counts=True)
        best = int(counts.argmax())
        prob *= int(counts[best]) / len(ends)
        if prob < min_token_prob:
            break
        token = int(values[best])
        draft.append(token)
        score += prob
        ends = ends[nxt == token] + 1
        ends = ends[ends < n - 1]  # those with a continuation
    return SuffixDraft(draft, score, match_len)


class _ActiveRequest:
    __slots__ = ("frontier", "output", "prompt_len")

    def __init__(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len
        self.output: list[int] = []
        self.frontier: list[_Node] = []


class SuffixDecodingProposer(Proposer):
    method = "suffix"

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        super().__init__(config, device)
        spec = config.speculative_config
        assert spec is not None
        self.max_tree_depth = spec.suffix_decoding_max_tree_depth
        self.max_cached_requests = spec.suffix_decoding_max_cached_requests
        self.max_spec_factor = spec.suffix_decoding_max_spec_factor
        self.min_token_prob = spec.suffix_decoding_min_token_prob
        self.max_model_len = config.max_seq_len
        self.trie = SuffixTrie(self.max_tree_depth)
        self.active: dict[str, _ActiveRequest] = {}
        # Finished requests' outputs still in the trie, oldest first.
        self.cached: OrderedDict[str, list[int]] = OrderedDict()

    def propose(self, inputs: ProposerInputs) -> list[list[int]]:
        drafts: list[list[int]] = []
        for req_id, row in zip(inputs.req_ids, inputs.rows.tolist(), strict=True):
            num_tokens = int(inputs.num_tokens[row])
            tokens = inputs.token_ids[row, :num_tokens]
            self._record_output(req_id, int(inputs.num_prompt_tokens[row]), tokens)
            max_spec = min(self.num_speculative_tokens, self.max_model_len - num_tokens - 1)
            if max_spec <= 0:
                drafts.append([])
                continue
            local = speculate_local(
                tokens, self.max_tree_depth, max_spec, self.max_spec_factor, self.min_token_prob
            )
            pattern = tokens[max(0, num_tokens - self.max_tree_depth) :].tolist()
            shared = self.trie.speculate(
                pattern, max_spec, self.max_spec_factor, self.min_token_prob
            )
            drafts.append((shared if shared.score > local.score else local).token_ids)
        return drafts

    def _record_output(self, req_id: str, prompt_len: int, tokens: np.ndarray) -> None:
        """Adds the tokens sampled since the last step to the request's output and trie."""
        state = self.active.get(req_id)
        if state is None:
            # A request id seen again (a client reusing it) replaces the cached output.
            old = self.cached.pop(req_id, None)
            if old is not None:
                self.trie.remove(old)
            state = self.active[req_id] = _ActiveRequest(prompt_len)
        new = tokens[state.prompt_len + len(state.output) :].tolist()
        if new:
            state.output += new
            if self.max_cached_requests:
                state.frontier = self.trie.extend(state.frontier, new)

    def remove_requests(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            state = self.active.pop(req_id, None)
            if state is None or not self.max_cached_requests:
                continue
            self.cached[req_id] = state.output
        while len(self.cached) > self.max_cached_requests:
            _, output = self.cached.popitem(last=False)
            self.trie.remove(output)

    def request_census(self) -> dict[str, int]:
        return {"suffix_active_requests": len(self.active)}
