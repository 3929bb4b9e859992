"""``tensor.numpy()`` for CPU tensors that come back step after step, made once each."""

from __future__ import annotations

import numpy as np
import torch

# Enough for every persistent buffer view a runner's steps hand around; the oldest entry
# goes first.
MAX_KEPT = 256

_kept: dict[int, tuple[torch.Tensor, np.ndarray]] = {}


def numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """The numpy array sharing ``tensor``'s memory (a CPU tensor without grad).

    ``Tensor.numpy()`` is four trips through torch's dispatcher (detach, to, resolve_conj,
    resolve_neg): a few microseconds each in a single-stream step, whose Python runs with
    the caches the forward has just flushed. The runner's step buffers and their cached
    prefix views are the same tensor objects every step, so their arrays are kept, keyed
    by the tensor object (held here, so its id cannot be reused while kept). Only single
    dict operations touch the table, so engines in several threads of one process may
    share it.
    """
    kept = _kept.get(id(tensor))
    if kept is not None and kept[0] is tensor:
        return kept[1]
    array = tensor.numpy()
    if len(_kept) >= MAX_KEPT:
        _kept.pop(next(iter(_kept)), None)
    _kept[id(tensor)] = (tensor, array)
    return array
