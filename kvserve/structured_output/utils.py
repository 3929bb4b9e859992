"""Helpers shared by the backends and the worker: spec conversions and the bitmask apply."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch


def choice_as_ebnf(choices: list[str]) -> str:
    """`root ::= "a" | "b"`: JSON string escapes are valid EBNF string escapes."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def choice_as_lark(choices: list[str]) -> str:
    return "start: " + " | ".join(json.dumps(c) for c in choices)


def legacy_structural_tag(tag: Any) -> tuple[list[dict[str, Any]], list[str]] | None:
    """vLLM's structural tag form, {"structures": [{begin, schema, end}], "triggers": [...]},
    as (structures, triggers); None for another form. Raises ValueError when malformed."""
    if not isinstance(tag, dict) or "structures" not in tag:
        return None
    structures, triggers = tag["structures"], tag.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list) or not triggers:
        raise ValueError("a structural tag needs a 'structures' list and a 'triggers' list")
    for s in structures:
        if not isinstance(s, dict) or not {"begin", "schema", "end"} <= s.keys():
            raise ValueError("each structure needs 'begin', 'schema' and 'end'")
    return structures, triggers


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
