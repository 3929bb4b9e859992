from __future__ import annotations

import numpy as np
import torch

from kvserve.utils import numpy_views
from kvserve.utils.numpy_views import numpy_view


def test_a_recurring_tensor_gets_its_array_once_and_shares_memory() -> None:
    t = torch.arange(6, dtype=torch.int32)
    a = numpy_view(t)
    assert a is numpy_view(t)
    t[2] = 42
    assert a[2] == 42
    a[0] = -1
    assert int(t[0]) == -1
    np.testing.assert_array_equal(a, t.numpy())


def test_a_new_tensor_never_gets_a_dead_tensors_array() -> None:
    # Ids are reused once an object dies; the kept entry holds its tensor, so an id in the
    # cache always belongs to the live tensor it was made for.
    for i in range(2 * numpy_views.MAX_KEPT):
        t = torch.full((3,), i)
        assert numpy_view(t).tolist() == [i, i, i]
        del t  # its id is free for the next tensor once the cache lets go of it
    assert len(numpy_views._kept) <= numpy_views.MAX_KEPT
