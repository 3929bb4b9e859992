from __future__ import annotations

import torch

from kvserve.worker.prefix_views import PrefixViews


def test_views_are_made_once_and_follow_the_buffer() -> None:
    buf = torch.arange(10)
    views = PrefixViews(buf)
    first = views[4]
    assert first is views[4]  # kept, not sliced again
    assert first.tolist() == [0, 1, 2, 3]
    assert views[7].tolist() == list(range(7))
    buf[:4] = torch.tensor([9, 8, 7, 6])
    assert first.tolist() == [9, 8, 7, 6]  # shares the buffer's storage
    assert first.data_ptr() == buf.data_ptr()
    assert views[0].numel() == 0
