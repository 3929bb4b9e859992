"""The ``Attention`` module models call, plus helpers to find layers and bind caches."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention.backends.abstract import AttentionBackend
from kvserve.attention.backends.registry import get_attn_backend
from kvserve.forward_context import get_forward_context


class Attention(nn.Module):
    """Paged attention over this layer's slice of the KV cache.

    The backend is chosen from the default device at construction time, so build the
    model under ``with torch.device(device):`` (``get_model`` does) and have the model
    runner use the same ``get_attn_backend(device)`` to build metadata.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        layer_name: str,
        sliding_window: int | None = None,
        attention_chunk_size: int | None = None,
        logits_soft_cap: float | None = None,
        attn_type: str = "decoder",
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.layer_name = layer_name
        # Read by the model runner to choose the layer's KV cache spec.
        self.sliding_window = sliding_window
        self.attention_chunk_size = attention_chunk_size
        self.logits_soft_cap = logits_soft_cap
        self.backend: type[AttentionBackend] = get_attn_backend(torch.get_default_device())
        self.impl = self.backend.get_impl_cls()(
            num_heads, head_size, scale, num_kv_heads, sliding_window,
            attention_chunk_size, logits_soft_cap,
        )  # fmt: skip
        # vLLM's AttentionType: "encoder_only" layers (BERT) attend both ways, within a
        # prompt the scheduler runs whole (see EngineConfig._configure_pooling).
        if attn_type not in ("decoder", "encoder_only"):
            raise ValueError(f"attn_type must be 'decoder' or 'encoder_only', got {attn_type!r}")
        self.impl.causal = attn_type == "decoder"
        # A plain attribute, not a buffer: the runner owns the memory, and it must not
        # show up in state_dict() or be copied by .to().
        self.kv_cache: torch.Tensor = torch.empty(0)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_size)
        k = key.view(num_tokens, self.num_kv_heads, self.head_size)
        v = value.view(num_tokens, self.num_kv_heads, self.head_size)
        return self.run(q, k, v).reshape(num_tokens, -1)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The step's attention over the paged cache through ``impl`` (with the KV
        connector's per-layer hooks), or without a cache in a profiling run; ``q``,
        ``k``, ``v`` are per head, the result ``[T, heads, head dim]``."""
        forward_context = get_forward_context()
        attn_metadata = forward_context.attn_metadata
        if isinstance(attn_metadata, dict):  # per-layer metadata (e.g. mixed window groups)
            attn_metadata = attn_metadata[self.layer_name]
        if attn_metadata is None:
            # Profiling / warm-up run without a KV cache: treat the tokens as one
            # causal sequence so shapes and compute match a real step.
            out = self._causal_no_cache(q, k, v)
        else:
            if self.kv_cache.numel() == 0:
                raise RuntimeError(f"{self.layer_name}: KV cache not bound (bind_kv_cache)")
            # KV connector hooks: external KV of this layer must be in place before the
            # attention reads it; this step's KV is written by impl.forward, then saved.
            connector = forward_context.kv_connector
            if connector is not None:
                connector.wait_for_layer_load(self.layer_name)
            out = self.impl.forward(self, q, k, v, self.kv_cache, attn_metadata)
            if connector is not None:
                connector.save_kv_layer(self.layer_name, self.kv_cache, attn_metadata)
        return out

    def _causal_no_cache(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # Shapes and compute only: window, chunk and soft-cap do not change either.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            is_causal=True,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out.transpose(0, 1)

    def extra_repr(self) -> str:
        return (
            f"{self.layer_name}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_size={self.head_size}, backend={self.backend.get_name()}"
            + (f", sliding_window={self.sliding_window}" if self.sliding_window else "")
            + (f", chunk={self.attention_chunk_size}" if self.attention_chunk_size else "")
            + (f", soft_cap={self.logits_soft_cap}" if self.logits_soft_cap else "")
        )


def get_attention_layers(model: nn.Module) -> dict[str, Attention]:
    """``layer_name -> Attention`` in model order."""
    layers: dict[str, Attention] = {}
    for module in model.modules():
        if isinstance(module, Attention):
            if module.layer_name in layers:
                raise ValueError(f"duplicate attention layer name {module.layer_name!r}")
            layers[module.layer_name] = module
    return layers


def kv_cache_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block costs across all layers; the runner divides free memory by this."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    total = 0
    for layer in get_attention_layers(model).values():
        shape = layer.backend.get_kv_cache_shape(1, block_size, layer.num_kv_heads, layer.head_size)
        total += itemsize * int(torch.Size(shape).numel())
    return total


def allocate_kv_caches(
    model: nn.Module,
    num_blocks: int,
    block_size: int,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """One zeroed tensor per attention layer, shaped by the layer's backend."""
    caches: dict[str, torch.Tensor] = {}
    for name, layer in get_attention_layers(model).items():
        shape = layer.backend.get_kv_cache_shape(
            num_blocks, block_size, layer.num_kv_heads, layer.head_size
        )
        caches[name] = torch.zeros(shape, dtype=dtype, device=device)
    return caches


def bind_kv_cache(model: nn.Module, kv_caches: dict[str, torch.Tensor]) -> None:
    """Point every attention layer at its cache tensor (shared, not copied)."""
    layers = get_attention_layers(model)
    missing = sorted(set(layers) - set(kv_caches))
    if missing:
        raise KeyError(f"no KV cache given for attention layers {missing}")
    for name, layer in layers.items():
        layer.kv_cache = kv_caches[name]
