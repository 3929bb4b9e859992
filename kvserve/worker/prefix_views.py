"""Cached ``buffer[:n]`` views of the runner's persistent step buffers."""

from __future__ import annotations

import torch

# Distinct prefixes kept per buffer before the cache starts over (a server sees a few
# hundred token counts; each view is a few hundred bytes).
MAX_VIEWS = 1024


class PrefixViews:
    """``tensor[:n]`` of one fixed buffer, made once per ``n`` and kept.

    A step slices the same few prefixes of the same buffers every time (one per request
    count and token count it sees), and each slice is a trip through torch's dispatcher:
    a few microseconds apiece in a single-stream step, whose Python runs with caches the
    forward's weight stream has just flushed. The views share the buffer's storage, so a
    kept view always shows the buffer's current values.
    """

    __slots__ = ("_views", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self._views: dict[int, torch.Tensor] = {}

    def __getitem__(self, n: int) -> torch.Tensor:
        view = self._views.get(n)
        if view is None:
            if len(self._views) >= MAX_VIEWS:
                self._views.clear()
            view = self._views[n] = self.tensor[:n]
        return view
