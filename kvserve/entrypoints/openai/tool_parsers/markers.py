"""Text markers that open a model's tool calls: where one starts, and how much of a
streamed text's tail may still become one."""

from __future__ import annotations


def find_first(text: str, markers: tuple[str, ...]) -> int | None:
    """Where the earliest of ``markers`` starts in ``text``, if any does."""
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    return min(found) if found else None


def partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a marker."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-n:]):
                longest = n
                break
    return longest


def held_at_start(text: str, openers: tuple[str, ...]) -> int:
    """For formats whose calls can only open the output: hold the whole (stripped) text
    back while it may still become one of ``openers``."""
    stripped = text.lstrip()
    if not stripped or any(o.startswith(stripped) for o in openers):
        return len(text)
    return 0
