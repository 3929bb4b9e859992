"""How much KV each attention layer needs per block, and how the cache is laid out.

One spec per attention layer (vLLM's names). Layers with equal specs form a KV cache
group with one block table per request. Groups share one block pool and, where their
pages are the same size, the physical memory too (vLLM's hybrid allocator): the groups
are cut to the same number of layers, and tensor ``i`` serves layer ``i`` of every group,
so one block id costs ``group_size`` layer pages whatever the mix of attention types.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec:
    """Every token attends to every earlier one: a request holds all its blocks."""

    kind: ClassVar[str] = "full_attention"
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_size: int = 4  # bytes per element (float32)
    # Bytes after each (token, head) row of K and of V: an int8 cache's scale.
    row_scale_bytes: int = 0

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block takes in one layer: K and V."""
        row = self.head_size * self.dtype_size + self.row_scale_bytes
        return 2 * self.block_size * self.num_kv_heads * row

    @property
    def type_id(self) -> str:
        return f"{self.kind}_{self.block_size}_{self.page_size_bytes}"

    def max_num_blocks(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        """Most blocks one request of num_tokens tokens holds at once in this group."""
        return cdiv(num_tokens, self.block_size)

    @property
    def attends_to_all(self) -> bool:
        """Every earlier token stays visible (full attention, MLA): the request keeps all
        its blocks and the full-attention manager serves the group."""
        return self.kind in FULL_ATTENTION_KINDS


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(FullAttentionSpec):
    """A query at position q sees keys q-sliding_window+1 .. q; older blocks are freed."""

    kind: ClassVar[str] = "sliding_window"
    sliding_window: int

    def __post_init__(self) -> None:
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    @property
    def type_id(self) -> str:
        return f"{self.kind}_{self.sliding_window}_{self.block_size}_{self.page_size_bytes}"

    def max_num_blocks(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        # The window behind the first query of a step plus the step's own tokens; +1 as the
        # window need not start on a block boundary.
        live = min(self.sliding_window - 1 + max_num_batched_tokens, num_tokens)
        return min(cdiv(live, self.block_size) + 1, cdiv(num_tokens, self.block_size))


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(FullAttentionSpec):
    """Llama 4's local layers: a query sees only keys of its own attention_chunk_size
    chunk (positions ``q // C * C .. q``); blocks of earlier chunks are freed."""

    kind: ClassVar[str] = "chunked_local_attention"
    attention_chunk_size: int

    def __post_init__(self) -> None:
        if self.attention_chunk_size % self.block_size:
            raise ValueError(
                f"attention_chunk_size ({self.attention_chunk_size}) must be a multiple of "
                f"the block size ({self.block_size})"
            )

    @property
    def type_id(self) -> str:
        size = self.attention_chunk_size
        return f"{self.kind}_{size}_{self.block_size}_{self.page_size_bytes}"

    def max_num_blocks(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        live = min(self.attention_chunk_size + max_num_batched_tokens, num_tokens)
        return min(cdiv(live, self.block_size) + 1, cdiv(num_tokens, self.block_size))


@dataclass(frozen=True, kw_only=True)
class SinkFullAttentionSpec(FullAttentionSpec):
    """StreamingLLM on a full-attention layer: the first sink_len tokens stay visible
    forever, the rest is a sliding window of sliding_window tokens.

    Position rule: keys keep the absolute positions they were rotated with when written,
    and a query uses its own absolute position, so positions keep growing past the
    model's context length (the rotary tables extend on demand). This is the rule a
    cache of already-rotated keys allows; StreamingLLM's re-indexing inside the cache
    would need un-rotated keys.
    """

    kind: ClassVar[str] = "sink_full_attention"
    sink_len: int
    sliding_window: int

    @property
    def num_sink_blocks(self) -> int:
        return cdiv(self.sink_len, self.block_size)

    @property
    def type_id(self) -> str:
        window = f"{self.sink_len}_{self.sliding_window}"
        return f"{self.kind}_{window}_{self.block_size}_{self.page_size_bytes}"

    def max_num_blocks(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        live = min(self.sliding_window - 1 + max_num_batched_tokens, num_tokens)
        window_blocks = cdiv(live, self.block_size) + 1
        return min(self.num_sink_blocks + window_blocks, cdiv(num_tokens, self.block_size))


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head Latent Attention (DeepSeek): a token caches one latent of
    ``kv_lora_rank + qk_rope_head_dim`` values per layer (``head_size``, with
    ``num_kv_heads == 1``), shared by every query head, instead of K and V per KV head."""

    kind: ClassVar[str] = "mla_attention"

    def __post_init__(self) -> None:
        if self.num_kv_heads != 1:
            raise ValueError(
                f"MLA caches one latent per token, got num_kv_heads={self.num_kv_heads}"
            )

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block takes in one layer: the latent only, no separate V."""
        return self.block_size * self.head_size * self.dtype_size


@dataclass(frozen=True, kw_only=True)
class MambaSpec(FullAttentionSpec):
    """A Mamba layer: one block holds one request's whole recurrent state (the conv1d's
    last inputs and the SSM state, float32), whatever the request's length, so a request
    holds exactly one block of the group (vLLM's MambaSpec).

    ``block_size`` is the pool's token block size (the hybrid coordinator's unit);
    ``page_size_padded`` pads the state to the attention groups' page so the groups share
    tensors (vLLM's hybrid allocator), 0 = the state's own bytes. The attention fields
    are unused (0).
    """

    kind: ClassVar[str] = "mamba"
    num_kv_heads: int = 0
    head_size: int = 0
    conv_state_shape: tuple[int, ...]
    ssm_state_shape: tuple[int, ...]
    page_size_padded: int = 0
    # vLLM's mamba_cache_mode: "none" (one state block per request) or "align" (prefix
    # caching: block-end states are cache entries, core/mamba_manager.py).
    mamba_cache_mode: str = "none"

    def __post_init__(self) -> None:
        if self.mamba_cache_mode not in ("none", "align"):
            raise ValueError(
                f"mamba_cache_mode must be 'none' or 'align', got {self.mamba_cache_mode!r}"
            )

    @property
    def state_bytes(self) -> int:
        numel = math.prod(self.conv_state_shape) + math.prod(self.ssm_state_shape)
        return numel * self.dtype_size

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded and self.page_size_padded < self.state_bytes:
            raise ValueError(
                f"page_size_padded {self.page_size_padded} < the state's {self.state_bytes} bytes"
            )
        return self.page_size_padded or self.state_bytes

    def max_num_blocks(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        # Align mode: the entry read, the block ends the last step wrote (until hashed,
        # core/mamba_manager.py) and the two entries of the step about to run.
        return 5 if self.mamba_cache_mode == "align" else 1


@dataclass(frozen=True, kw_only=True)
class CrossAttentionSpec(FullAttentionSpec):
    """A decoder's cross-attention over its encoder's output (Whisper): a request holds
    the K/V of its ``max_encoder_len`` encoder positions from its first step to its end,
    however long its decoder sequence grows. The blocks are keyed by the encoder input's
    hash, never by the decoder's tokens (``CrossAttentionManager``)."""

    kind: ClassVar[str] = "cross_attention"
    max_encoder_len: int

    def __post_init__(self) -> None:
        if self.max_encoder_len < 1:
            raise ValueError(f"max_encoder_len must be >= 1, got {self.max_encoder_len}")

    @property
    def type_id(self) -> str:
        return f"{self.kind}_{self.max_encoder_len}_{self.block_size}_{self.page_size_bytes}"

    def max_num_blocks(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        return cdiv(self.max_encoder_len, self.block_size)


FULL_ATTENTION_KINDS = (FullAttentionSpec.kind, MLAAttentionSpec.kind)
KVCacheSpec = FullAttentionSpec  # every spec is one; the subclasses say which manager


@dataclass
class KVCacheGroupSpec:
    """Layers that share one block table (same spec)."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


@dataclass
class KVCacheTensor:
    """One physical KV tensor of num_blocks pages, used by the layers in shared_by (at
    most one layer of each group: their block ids never collide, the pool hands each
    block to one group at a time)."""

    shared_by: list[str]


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_groups: list[KVCacheGroupSpec] = field(default_factory=list)
    # Empty means one tensor per layer (configs built by hand in tests).
    kv_cache_tensors: list[KVCacheTensor] = field(default_factory=list)

    @property
    def block_size(self) -> int:
        return self.kv_cache_groups[0].kv_cache_spec.block_size

    def get_kv_cache_tensors(self) -> list[KVCacheTensor]:
        if self.kv_cache_tensors:
            return self.kv_cache_tensors
        return [KVCacheTensor([n]) for g in self.kv_cache_groups for n in g.layer_names]

    @property
    def bytes_per_block(self) -> int:
        """Memory one block id costs across all tensors."""
        page = {n: g.kv_cache_spec.page_size_bytes for g in self.kv_cache_groups
                for n in g.layer_names}  # fmt: skip
        return sum(max(page[n] for n in t.shared_by) for t in self.get_kv_cache_tensors())


def _group_layers(layer_specs: dict[str, KVCacheSpec]) -> list[tuple[KVCacheSpec, list[str]]]:
    """Layers grouped by spec, groups in the order of their first layer, full attention
    first (the hybrid coordinator's lookup starts with it)."""
    groups: dict[KVCacheSpec, list[str]] = {}
    for name, spec in layer_specs.items():
        groups.setdefault(spec, []).append(name)
    return sorted(groups.items(), key=lambda item: not item[0].attends_to_all)


def _split_into_groups(
    by_spec: list[tuple[KVCacheSpec, list[str]]],
) -> tuple[list[KVCacheGroupSpec], list[KVCacheTensor]]:
    """Equal-sized groups sharing tensors: each spec's layers are cut into groups of
    group_size (the smallest spec's layer count, so no tensor idles in the common case)."""
    group_size = min(len(names) for _, names in by_spec)
    groups = [
        KVCacheGroupSpec(names[start : start + group_size], spec)
        for spec, names in by_spec
        for start in range(0, len(names), group_size)
    ]
    tensors = [
        KVCacheTensor([g.layer_names[i] for g in groups if i < len(g.layer_names)])
        for i in range(group_size)
    ]
    return groups, tensors


def build_kv_cache_config(
    layer_specs: dict[str, KVCacheSpec], memory_bytes: int, num_blocks_override: int | None = None
) -> KVCacheConfig:
    """Groups layers by spec and sizes the shared block pool to fit memory_bytes.

    One kind of attention: one group, a tensor per layer. Several kinds with one page
    size: equal groups over shared tensors (see the module docstring). Several page sizes
    cannot share a tensor: every layer keeps its own and a block id costs all of them.
    """
    if not layer_specs:
        raise ValueError("the model has no attention layers to allocate a KV cache for")
    by_spec = _group_layers(layer_specs)
    page_sizes = {spec.page_size_bytes for spec, _ in by_spec}
    if len(by_spec) > 1 and len(page_sizes) == 1:
        groups, tensors = _split_into_groups(by_spec)
    else:
        groups = [KVCacheGroupSpec(names, spec) for spec, names in by_spec]
        tensors = [KVCacheTensor([name]) for name in layer_specs]
    config = KVCacheConfig(num_blocks=0, kv_cache_groups=groups, kv_cache_tensors=tensors)
    bytes_per_block = config.bytes_per_block
    num_blocks = num_blocks_override or memory_bytes // bytes_per_block
    if num_blocks < 2:
        raise ValueError(
            f"kv_cache_memory={memory_bytes} bytes holds {num_blocks} KV blocks "
            f"({bytes_per_block} bytes each); at least 2 are needed (one is the null block)"
        )
    config.num_blocks = num_blocks
    return config


def max_tokens_per_request(config: KVCacheConfig, max_num_batched_tokens: int) -> int:
    """The longest single request the pool could hold with every block free (for the
    start-up log): full attention grows with the request, windows stay bounded."""
    usable = config.num_blocks - 1
    per_token = sum(1 for g in config.kv_cache_groups if g.kv_cache_spec.attends_to_all)
    bounded = sum(
        g.kv_cache_spec.max_num_blocks(1 << 40, max_num_batched_tokens)
        for g in config.kv_cache_groups
        if not g.kv_cache_spec.attends_to_all
    )
    if per_token == 0:
        return 1 << 40 if bounded <= usable else 0
    return max(usable - bounded, 0) // per_token * config.block_size


def kv_bytes_per_token(config: KVCacheConfig) -> float:
    """KV memory one token of context costs across all layers (the start-up log's
    tokens-per-GiB figure: MLA's latent shows here)."""
    return config.bytes_per_block / config.block_size


def group_capacity_per_gib(config: KVCacheConfig) -> list[tuple[str, int]]:
    """Per group, what one GiB of the pool holds for it (the start-up log): attention
    groups in tokens, Mamba groups in requests (one state block each). Every group's
    block id costs ``bytes_per_block``, as the groups share the pool's memory."""
    blocks_per_gib = (1 << 30) // config.bytes_per_block
    return [
        (
            g.kv_cache_spec.kind,
            blocks_per_gib * (1 if g.kv_cache_spec.kind == MambaSpec.kind else config.block_size),
        )
        for g in config.kv_cache_groups
    ]


def max_concurrent_requests(
    config: KVCacheConfig, num_tokens: int, max_num_batched_tokens: int
) -> int:
    """How many requests of num_tokens tokens the pool holds at once."""
    per_request = sum(
        g.kv_cache_spec.max_num_blocks(num_tokens, max_num_batched_tokens)
        for g in config.kv_cache_groups
    )
    return (config.num_blocks - 1) // per_request


__all__ = [
    "FULL_ATTENTION_KINDS",
    "ChunkedLocalAttentionSpec",
    "CrossAttentionSpec",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "KVCacheTensor",
    "MLAAttentionSpec",
    "MambaSpec",
    "SinkFullAttentionSpec",
    "SlidingWindowSpec",
    "build_kv_cache_config",
    "cdiv",
    "group_capacity_per_gib",
    "kv_bytes_per_token",
    "max_concurrent_requests",
    "max_tokens_per_request",
]
