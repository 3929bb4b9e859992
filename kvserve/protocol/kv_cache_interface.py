"""How much KV each attention layer needs per block, and how the cache is laid out."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_size: int = 4  # bytes per element (float32)
    sliding_window: int | None = None  # None = full attention; set = SlidingWindow manager

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block takes in one layer: K and V."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_size

    @property
    def type_id(self) -> str:
        kind = "full" if self.sliding_window is None else f"sliding_window_{self.sliding_window}"
        return f"{kind}_{self.block_size}_{self.page_size_bytes}"


KVCacheSpec = FullAttentionSpec


@dataclass
class KVCacheGroupSpec:
    """Layers that share one block table (same spec)."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_groups: list[KVCacheGroupSpec] = field(default_factory=list)

    @property
    def block_size(self) -> int:
        return self.kv_cache_groups[0].kv_cache_spec.block_size


def build_kv_cache_config(
    layer_specs: dict[str, KVCacheSpec], memory_bytes: int, num_blocks_override: int | None = None
) -> KVCacheConfig:
    """Groups layers by spec and sizes the shared block pool to fit memory_bytes.

    Every layer gets a tensor of num_blocks blocks, so one block id costs the sum of
    all layers' page sizes.
    """
    if not layer_specs:
        raise ValueError("the model has no attention layers to allocate a KV cache for")
    groups: dict[KVCacheSpec, list[str]] = {}
    for name, spec in layer_specs.items():
        groups.setdefault(spec, []).append(name)
    bytes_per_block = sum(spec.page_size_bytes for spec in layer_specs.values())
    num_blocks = num_blocks_override or memory_bytes // bytes_per_block
    if num_blocks < 2:
        raise ValueError(
            f"kv_cache_memory={memory_bytes} bytes holds {num_blocks} KV blocks "
            f"({bytes_per_block} bytes each); at least 2 are needed (one is the null block)"
        )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_groups=[KVCacheGroupSpec(names, spec) for spec, names in groups.items()],
    )
