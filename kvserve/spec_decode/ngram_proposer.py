"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the
sequence's own suffix (in the prompt or the output so far). No model; numpy only."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvserve.spec_decode.proposer import Proposer, ProposerInputs

if TYPE_CHECKING:
    import torch

    from kvserve.config import EngineConfig


class NgramProposer(Proposer):
    method = "ngram"

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        super().__init__(config, device)
        spec = config.speculative_config
        assert spec is not None
        assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
        self.min_n = spec.prompt_lookup_min
        self.max_n = spec.prompt_lookup_max

    def propose(self, inputs: ProposerInputs) -> list[list[int]]:
        return [
            find_ngram_draft(
                inputs.token_ids[row, : inputs.num_tokens[row]],
                self.min_n,
                self.max_n,
                self.num_speculative_tokens,
            )
            for row in inputs.rows.tolist()
        ]


def find_ngram_draft(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the longest earlier match (min_n..max_n tokens long) of
    the sequence's suffix; among equally long matches the latest. [] when none matches.

    Vectorised over candidate positions: every earlier position holding the last token is a
    candidate end, and the match is extended backwards one offset at a time for all of them.
    """
    length = len(tokens)
    if length < min_n + 1:
        return []
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    if not len(ends):
        return []
    match_len = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for offset in range(1, max_n):
        starts = ends - offset
        alive &= starts >= 0
        alive[alive] = tokens[starts[alive]] == tokens[length - 1 - offset]
        if not alive.any():
            break
        match_len += alive
    best = int(match_len.max())
    if best < min_n:
        return []
    end = int(ends[np.flatnonzero(match_len == best)[-1]])
    return tokens[end + 1 : end + 1 + k].tolist()
