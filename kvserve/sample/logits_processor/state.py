"""Collects batch changes into a BatchUpdate and holds the batch's logits processors."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvserve.sample.logits_processor.interface import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    MovedRequest,
)


class BatchUpdateBuilder:
    """Records adds/removes/moves until the next `get_and_reset`.

    A BatchUpdate is applied as added -> removed -> moved, so the caller must flush before
    recording an add or a remove after a move (`has_moves` tells when)."""

    def __init__(self) -> None:
        self.added: list[AddedRequest] = []
        self.removed: list[int] = []
        self.moved: list[MovedRequest] = []

    def has_moves(self) -> bool:
        return bool(self.moved)

    def add(self, entry: AddedRequest) -> None:
        row = entry[0]
        # The row is refilled: it is no longer a hole, and a newer add replaces an older one.
        self.removed = [r for r in self.removed if r != row]
        self.added = [a for a in self.added if a[0] != row]
        self.added.append(entry)

    def remove(self, row: int) -> None:
        self.added = [a for a in self.added if a[0] != row]
        if row not in self.removed:
            self.removed.append(row)

    def move(self, src: int, dst: int, direction: MoveDirectionality) -> None:
        self.moved.append((src, dst, direction))

    def get_and_reset(self, batch_size: int) -> BatchUpdate | None:
        if not (self.added or self.removed or self.moved):
            return None
        update = BatchUpdate(batch_size, self.added, self.removed, self.moved)
        self.added, self.removed, self.moved = [], [], []
        return update


class LogitsProcessors:
    """The processors of one batch, split by whether they can change a row's argmax."""

    def __init__(self, processors: Iterable[LogitsProcessor] = ()) -> None:
        self.argmax_invariant: list[LogitsProcessor] = []
        self.non_argmax_invariant: list[LogitsProcessor] = []
        for proc in processors:
            if proc.is_argmax_invariant():
                self.argmax_invariant.append(proc)
            else:
                self.non_argmax_invariant.append(proc)

    def __iter__(self) -> Iterator[LogitsProcessor]:
        yield from self.non_argmax_invariant
        yield from self.argmax_invariant

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        for proc in self:
            proc.update_state(batch_update)

    def request_census(self) -> dict[str, int]:
        """Rows each processor keeps state for (processors that keep none are left out)."""
        return {
            type(proc).__name__: len(states)
            for proc in self
            if isinstance(states := getattr(proc, "states", None), dict)
        }
