from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """The tests' own torch ops on one thread (the kernel calls set theirs): on a loaded
    2-core machine, spinning OpenMP teams made the many small ops 10-100x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
