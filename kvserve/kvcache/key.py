"""CacheEngineKey: the name of one chunk of KV in every tier, and its string form.

The string form is what disk headers, Redis keys and the cache server carry:

    <model>@<world_size>@<worker_id>@<chunk_hash hex>@<dtype>[@<tag>=<value>,...]

Each field is percent-encoded, so a model name holding '@' or '/' round-trips.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import quote, unquote


@dataclass(frozen=True)
class CacheEngineMetadata:
    """What, besides the tokens, decides a chunk's KV: the model and this worker's shard."""

    model_name: str
    world_size: int = 1
    worker_id: int = 0
    kv_dtype: str = "float32"


@dataclass(frozen=True)
class CacheEngineKey:
    model_name: str
    world_size: int
    worker_id: int
    chunk_hash: str  # hex sha256, chained over every earlier chunk (see chunking.py)
    dtype: str
    tags: tuple[tuple[str, str], ...] = field(default=())

    def to_string(self) -> str:
        parts = [
            self.model_name,
            str(self.world_size),
            str(self.worker_id),
            self.chunk_hash,
            self.dtype,
        ]
        text = "@".join(quote(p, safe="") for p in parts)
        if self.tags:
            tag_text = ",".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in self.tags)
            text += "@" + tag_text
        return text

    def __str__(self) -> str:
        return self.to_string()

    @classmethod
    def from_string(cls, text: str) -> CacheEngineKey:
        parts = text.split("@")
        if len(parts) not in (5, 6):
            raise ValueError(f"not a CacheEngineKey string: {text!r}")
        model, world, worker, chunk_hash, dtype = (unquote(p) for p in parts[:5])
        tags: list[tuple[str, str]] = []
        if len(parts) == 6 and parts[5]:
            for item in parts[5].split(","):
                name, sep, value = item.partition("=")
                if not sep:
                    raise ValueError(f"bad tag {item!r} in CacheEngineKey {text!r}")
                tags.append((unquote(name), unquote(value)))
        try:
            return cls(model, int(world), int(worker), chunk_hash, dtype, tuple(tags))
        except ValueError as exc:
            raise ValueError(f"not a CacheEngineKey string: {text!r}") from exc
