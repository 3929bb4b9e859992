"""Applying a step's grammar bitmask to the logits: the worker's side of structured
outputs (the front end and the scheduler never import it)."""

from __future__ import annotations

import numpy as np
import torch


def apply_grammar_bitmask(
    logits: torch.Tensor,
    logits_rows: list[int],
    bitmask: np.ndarray,
) -> None:
    """Masks, in place, the tokens row ``bitmask[i]`` forbids out of ``logits[logits_rows[i]]``.

    Forbidden logits become -inf, so greedy and random sampling alike only pick allowed
    tokens. Rows not named stay as they are.
    """
    import xgrammar as xgr

    if not logits_rows:
        return
    # xgrammar indexes the logits and the bitmask with the same row ids: lay the rows out
    # at their logits rows, all-allowed elsewhere.
    full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
    full[logits_rows] = torch.from_numpy(bitmask)
    xgr.apply_token_bitmask_inplace(
        logits, full.to(logits.device), vocab_size=logits.shape[1], indices=logits_rows
    )
