"""Where a speculative step's drafts sit among the logits (vLLM's SpecDecodeMetadata)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class SpecDecodeMetadata:
    """One entry per sampling row of the step, in sampling-row order.

    A row with n drafts computed its last token and the n drafts after it, so it has n + 1
    logits: position j scores the token after draft j (position 0: after the last known
    token; position n: the bonus token once every draft was accepted).
    """

    draft_token_ids: list[list[int]]
    # cu_num_logits[i]:cu_num_logits[i+1] are row i's rows of the gathered logits.
    cu_num_logits: np.ndarray  # int64 [S+1]
    # Rows of the step's hidden states to compute logits for, in the same order.
    logits_indices: torch.Tensor  # int64 [sum(n_i + 1)], device

    @property
    def num_draft_tokens(self) -> list[int]:
        return [len(d) for d in self.draft_token_ids]

    @property
    def max_spec_len(self) -> int:
        return max(self.num_draft_tokens, default=0)

    @classmethod
    def make(
        cls,
        draft_token_ids: list[list[int]],
        last_token_indices: np.ndarray,
        device: torch.device,
    ) -> SpecDecodeMetadata:
        """``last_token_indices[i]``: the index of sampling row i's last scheduled token in
        the step's flattened tokens; its drafts are the tokens right before it."""
        num_logits = np.array([len(d) + 1 for d in draft_token_ids], dtype=np.int64)
        cu = np.zeros(len(num_logits) + 1, dtype=np.int64)
        np.cumsum(num_logits, out=cu[1:])
        # Index t of the gathered logits belongs to row r(t) at offset t - cu[r(t)].
        owner = np.repeat(np.arange(len(num_logits)), num_logits)
        offsets = np.arange(int(cu[-1])) - cu[owner]
        first = last_token_indices.astype(np.int64) - (num_logits - 1)
        indices = first[owner] + offsets
        return cls(draft_token_ids, cu, torch.from_numpy(indices).to(device))
