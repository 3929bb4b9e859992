"""CacheBlend's request options and the per-step plan the tiered connector's scheduler
side hands its worker side (pure Python: the front end validates the options with it).

A request opts in or out through ``kv_transfer_params``:

    {"blend": true, "blend_recompute_ratio": 0.3}

``blend`` defaults to the connector's ``enable_blending``; the ratio to its
``blend_recompute_ratio``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

BLEND_KEY = "blend"
RATIO_KEY = "blend_recompute_ratio"


@dataclass(frozen=True)
class BlendRequestParams:
    enabled: bool | None = None  # None: the connector's default
    recompute_ratio: float | None = None


def parse_blend_params(kv_transfer_params: Mapping[str, Any] | None) -> BlendRequestParams:
    """The blend options of a request's kv_transfer_params; ValueError names a bad field."""
    if not kv_transfer_params:
        return BlendRequestParams()
    enabled = kv_transfer_params.get(BLEND_KEY)
    if enabled is not None and not isinstance(enabled, bool):
        raise ValueError(f"kv_transfer_params.{BLEND_KEY} must be a boolean, got {enabled!r}")
    ratio = kv_transfer_params.get(RATIO_KEY)
    if ratio is not None:
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 <= ratio <= 1:
            raise ValueError(
                f"kv_transfer_params.{RATIO_KEY} must be a number in [0, 1], got {ratio!r}"
            )
        ratio = float(ratio)
    return BlendRequestParams(enabled, ratio)


@dataclass
class BlendSpec:
    """One request whose prompt tokens [start, end) run in this step, blended: the whole
    rest of the prompt, or one chunk of it under chunked prefill."""

    req_id: str
    token_ids: list[int]  # the prompt
    start: int
    end: int
    recompute_ratio: float
    tags: tuple[tuple[str, str], ...] = ()


def split_segments(token_ids: Sequence[int], separator: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of each segment before a separator, in order (LMCache's blend split:
    the separator's own tokens and the text after the last separator, the query, are in
    no segment, so they are always computed). Empty segments are left out."""
    sep = list(separator)
    n, width = len(token_ids), len(sep)
    segments: list[tuple[int, int]] = []
    if width == 0:
        return segments
    first = sep[0]
    start, i = 0, 0
    while i + width <= n:
        if token_ids[i] == first and list(token_ids[i : i + width]) == sep:
            if i > start:
                segments.append((start, i))
            i += width
            start = i
        else:
            i += 1
    return segments
