"""Where a multimodal item sits in a prompt, and what travels with it (vLLM's names)."""

from __future__ import annotations

from typing import Any

import msgspec


class PlaceholderRange(msgspec.Struct, frozen=True):
    """The ``length`` prompt positions from ``offset`` that an item's embeddings fill.

    ``is_embed``: which of those positions take an embedding (a boolean per position;
    None: all of them). Models frame an image's tokens with markers that stay ordinary
    text tokens, inside the range but not embeddings."""

    offset: int
    length: int
    is_embed: tuple[bool, ...] | None = None

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise ValueError(f"placeholder needs offset >= 0 and length > 0, got {self}")
        if self.is_embed is not None and len(self.is_embed) != self.length:
            raise ValueError(
                f"is_embed has {len(self.is_embed)} entries for a range of {self.length}"
            )

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def num_embeds(self) -> int:
        return self.length if self.is_embed is None else sum(self.is_embed)

    def overlaps(self, start: int, end: int) -> bool:
        """Whether prompt positions [start, end) (a scheduled chunk) touch this range."""
        return start < self.end and self.offset < end


class MultiModalFeatureSpec(msgspec.Struct):
    """One item of a request as the engine core sees it.

    ``identifier``: the item's content hash (MultiModalHasher), which keys the processor,
    encoder and prefix caches; ``data``: the processed inputs of the model's encoder, or
    None when the front end knows the core already holds them under ``identifier``."""

    modality: str
    identifier: str
    mm_position: PlaceholderRange
    data: dict[str, Any] | None = None
