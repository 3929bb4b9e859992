"""Multimodal items as the engine core sees them: where each sits in the prompt, its content
hash and its processed inputs (vLLM's names; msgspec, so they cross processes)."""

from __future__ import annotations

import msgspec
import numpy as np


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


class TensorData(msgspec.Struct, frozen=True, array_like=True):
    """A tensor on the wire: element type by name, shape and raw C-order bytes (no pickle).

    Built from numpy or torch; ``to_numpy`` views the bytes without a copy."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def from_array(cls, value: object) -> TensorData:
        if isinstance(value, np.ndarray):
            array = np.ascontiguousarray(value)
        else:  # a torch tensor (torch is only imported where tensors exist)
            array = np.ascontiguousarray(value.detach().cpu().numpy())  # type: ignore[attr-defined]
        if array.dtype.hasobject:
            raise ValueError("a tensor of Python objects cannot cross the wire")
        return cls(array.dtype.name, tuple(int(d) for d in array.shape), array.tobytes())

    def to_numpy(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)

    @property
    def nbytes(self) -> int:
        return len(self.data)


class MultiModalFeatureSpec(msgspec.Struct):
    """One item of a request as the engine core sees it.

    ``identifier``: the item's content hash (MultiModalHasher), which keys the processor,
    encoder and prefix caches; ``data``: the processed inputs of the model's encoder, or
    None when the front end knows the core already holds them under ``identifier``."""

    modality: str
    identifier: str
    mm_position: PlaceholderRange
    data: dict[str, TensorData] | None = None

    @property
    def data_nbytes(self) -> int:
        return sum(t.nbytes for t in (self.data or {}).values())
