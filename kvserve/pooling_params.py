"""Pooling parameters (per request) and the pooler's configuration (per model), with
vLLM's names.

A pooling request runs its prompt through the model once and returns one vector made
from the final hidden states (no tokens are sampled). How the vector is made is the
model's ``PoolerConfig`` (pooling type, normalisation); a request may turn
normalisation off or truncate the vector to ``dimensions`` (Matryoshka embeddings).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

# The pooling types (vLLM's PoolingType names): the last token's hidden state, the mean
# over all prompt tokens, the first token's (BERT's [CLS]).
POOLING_TYPES = ("LAST", "MEAN", "CLS")
POOLING_TASKS = ("embed", "encode")


class PoolingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How one request's vector is returned; a msgspec Struct so it crosses processes.

    ``normalize``: None takes the model's setting (True for ``embed``), False returns the
    raw pooled state. ``dimensions``: keep the first n values (then normalise).
    """

    task: str = "embed"
    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {POOLING_TASKS}, got {self.task!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")

    def verify(self, hidden_size: int) -> None:
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise ValueError(
                f"dimensions ({self.dimensions}) exceeds the model's embedding size ({hidden_size})"
            )


@dataclass
class PoolerConfig:
    """The model's pooler. ``pooling_type`` None: the model's default (sentence-transformers'
    ``1_Pooling/config.json`` where the checkpoint has one, else CLS for encoders and LAST
    for decoders)."""

    pooling_type: str | None = None
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            self.pooling_type = self.pooling_type.upper()
            if self.pooling_type not in POOLING_TYPES:
                raise ValueError(
                    f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}"
                )
