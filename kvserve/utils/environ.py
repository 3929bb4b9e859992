"""os.environ changed for a moment: what a child process started inside the block inherits."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


@contextmanager
def environ_set(values: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set inside the block, as it was after it."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
