"""The model runner's KV cache: the per-layer specs, the allocated (zeroed) tensors and
their binding to the attention and Mamba layers, plus the per-group metadata builders.

Owns the cache tensors; the runner asks it for specs and to bind a KVCacheConfig, then
reads ``kv_caches``, ``attn_builders``, ``layer_to_group`` and ``unsplit_groups``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from kvserve.attention.backends.abstract import AttentionMetadataBuilder
from kvserve.attention.backends.kv_cache_codec import packed_head_size
from kvserve.attention.backends.utils import CommonAttentionMetadata
from kvserve.attention.layer import Attention, bind_kv_cache
from kvserve.config import EngineConfig
from kvserve.model_executor.layers.mamba.mamba_metadata import MambaMetadataBuilder
from kvserve.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from kvserve.protocol.kv_cache_interface import KVCacheConfig, KVCacheSpec, MambaSpec
from kvserve.worker.kv_cache_specs import make_kv_cache_spec, make_mamba_spec, zeroed_tensor


class KVCacheBinder:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.cache_config = config.cache_config
        self.device = device
        self.kv_dtype_name = config.cache_config.kv_dtype(config.model_config.dtype)
        self.kv_cache_dtype: torch.dtype = getattr(torch, self.kv_dtype_name)
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.attn_builders: list[AttentionMetadataBuilder] = []
        # How each group's builder is made (new_builders: another set, e.g. a micro-batch's).
        self._builder_factories: list[Callable[[], AttentionMetadataBuilder]] = []
        self.layer_to_group: dict[str, int] = {}
        # Groups whose metadata is built from the unsplit rows (Mamba: a row's drafts are
        # one sequence through its state, not one-token queries).
        self.unsplit_groups: set[int] = set()

    @property
    def _itemsize(self) -> int:
        return torch.empty(0, dtype=self.kv_cache_dtype).element_size()

    def _row(self, head_size: int) -> int:
        """The cache tensor's last dim for a head: its values, then an int8 row's scale."""
        return packed_head_size(head_size, self.kv_dtype_name)

    @property
    def _row_scale_bytes(self) -> int:
        return self._row(0)

    def get_kv_cache_spec(
        self, layers: dict[str, Attention], mamba_layers: dict[str, MambaMixer2]
    ) -> dict[str, KVCacheSpec]:
        """One spec per attention layer, from the layer's own attention type, and one
        per Mamba layer (its state, padded to the attention page)."""
        block_size = self.cache_config.block_size
        specs = {
            name: make_kv_cache_spec(layer, block_size, self._itemsize, self._row_scale_bytes)
            for name, layer in layers.items()
        }
        page_size = max((spec.page_size_bytes for spec in specs.values()), default=0)
        for name, mamba in mamba_layers.items():
            specs[name] = make_mamba_spec(
                mamba, block_size, page_size, self.cache_config.enable_prefix_caching
            )
        return specs

    def bind(
        self,
        kv_cache_config: KVCacheConfig,
        model: torch.nn.Module,
        layers: dict[str, Attention],
        mamba_layers: dict[str, MambaMixer2],
    ) -> None:
        """Allocate the zeroed cache tensors (layers of different groups share them, see
        kv_cache_interface), bind them to the layers, make each group's builder."""
        self._allocate(kv_cache_config, layers, mamba_layers)
        self._make_builders(kv_cache_config, layers)
        bind_kv_cache(model, self.kv_caches)

    def _allocate(
        self,
        kv_cache_config: KVCacheConfig,
        layers: dict[str, Attention],
        mamba_layers: dict[str, MambaMixer2],
    ) -> None:
        self.kv_caches = {}
        page_sizes = {
            name: group.kv_cache_spec.page_size_bytes
            for group in kv_cache_config.kv_cache_groups
            for name in group.layer_names
        }
        num_blocks, block_size = kv_cache_config.num_blocks, kv_cache_config.block_size
        for tensor in kv_cache_config.get_kv_cache_tensors():
            # A pipeline stage allocates only the tensors of its own layers.
            shared_by = [
                name for name in tensor.shared_by if name in layers or name in mamba_layers
            ]
            if not shared_by:
                continue
            attention = [name for name in shared_by if name in layers]
            if attention:
                first = layers[attention[0]]
                shape = first.backend.get_kv_cache_shape(
                    num_blocks, block_size, first.num_kv_heads, self._row(first.head_size)
                )
            else:  # Mamba layers only: one plane of pages
                shape = (1, num_blocks, max(page_sizes[n] for n in shared_by) // self._itemsize)
            memory = zeroed_tensor(shape, self.kv_cache_dtype, self.device)
            for name in shared_by:
                if name in mamba_layers:  # the state's view of the same pages
                    mamba_layers[name].bind_state_cache(memory, num_blocks)
                    self.kv_caches[name] = memory
                    continue
                layer = layers[name]
                own = layer.backend.get_kv_cache_shape(
                    num_blocks, block_size, layer.num_kv_heads, self._row(layer.head_size)
                )
                # Equal page sizes share; the shapes may still differ (heads x head size).
                self.kv_caches[name] = memory if tuple(own) == tuple(shape) else memory.view(own)

    def _make_builders(self, kv_cache_config: KVCacheConfig, layers: dict[str, Attention]) -> None:
        self._builder_factories, self.layer_to_group, self.unsplit_groups = [], {}, set()
        for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            for name in group.layer_names:
                self.layer_to_group[name] = group_id
            if spec.kind == "mamba":
                self.unsplit_groups.add(group_id)
                assert isinstance(spec, MambaSpec)
                align = spec.mamba_cache_mode == "align"
                self._builder_factories.append(
                    partial(MambaMetadataBuilder, spec.block_size, self.device, align=align)
                )
                continue
            local = [name for name in group.layer_names if name in layers] or list(layers)
            builder_cls = layers[local[0]].backend.get_builder_cls()
            self._builder_factories.append(partial(builder_cls, spec.block_size, self.device))
        self.attn_builders = self.new_builders()

    def new_builders(self) -> list[AttentionMetadataBuilder]:
        """A set of builders like ``attn_builders``, one per group. A builder reuses its
        buffers from one build to the next, so metadata that must live side by side in
        one step (two micro-batches') come from sets of their own."""
        return [make() for make in self._builder_factories]

    def build_metadata(
        self,
        commons: Sequence[CommonAttentionMetadata],
        unsplit: Sequence[Any] = (),
        builders: Sequence[AttentionMetadataBuilder] | None = None,
    ) -> Any:
        """The step's attention metadata: one group's, or a dict by layer name. An
        ``unsplit_groups`` group builds from ``unsplit``'s entry (its rows before spec
        decode split them)."""
        per_group = [
            builder.build(unsplit[g] if g in self.unsplit_groups else common)
            for g, (builder, common) in enumerate(
                zip(builders or self.attn_builders, commons, strict=True)
            )
        ]
        if len(per_group) == 1:
            return per_group[0]
        return {name: per_group[g] for name, g in self.layer_to_group.items()}
