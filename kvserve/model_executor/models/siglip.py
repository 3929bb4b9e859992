"""SigLIP's vision tower (``SiglipVisionModel`` without the pooling head): Gemma 3's image
encoder.

An image is cut into ``patch_size`` squares by a strided convolution, each patch gets a
learned position embedding, and a pre-norm transformer with bidirectional attention (every
patch sees every patch of its image) encodes them; a final LayerNorm follows. It keeps no
KV cache: one image is encoded whole, once, and its output cached by content hash
(core/encoder_cache_manager.py). Module and parameter names are HF's, so a checkpoint's
``vision_tower.*`` tensors load by name, with or without the ``vision_model.`` level that
checkpoints written by transformers 4 have.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class SiglipVisionArch:
    """The numbers of a SigLIP vision config (HF ``SiglipVisionConfig``) the tower needs."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str = "gelu_pytorch_tanh"

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> SiglipVisionArch:
        defaults = {"num_channels": 3, "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh"}
        fields = {k: config.get(k, defaults.get(k)) for k in cls.__dataclass_fields__}
        missing = sorted(k for k, v in fields.items() if v is None)
        if missing:
            raise ValueError(f"vision_config lacks {', '.join(missing)}")
        return cls(**fields)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def _activation(name: str) -> Any:
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise ValueError(f"unsupported vision activation {name!r}")


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, arch: SiglipVisionArch) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            arch.num_channels, arch.hidden_size, arch.patch_size, stride=arch.patch_size
        )
        self.position_embedding = nn.Embedding(arch.num_patches, arch.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[images, channels, H, W]`` -> ``[images, patches, hidden]``."""
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        embeddings = patches.flatten(2).transpose(1, 2)
        return embeddings + self.position_embedding.weight


class SiglipAttention(nn.Module):
    def __init__(self, arch: SiglipVisionArch) -> None:
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.head_dim = arch.hidden_size // arch.num_attention_heads
        self.scale = self.head_dim**-0.5
        hidden = arch.hidden_size
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        images, patches, _ = x.shape
        shape = (images, patches, self.num_heads, self.head_dim)
        q, k, v = (
            p(x).view(shape).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v, scale=self.scale)  # bidirectional
        return self.out_proj(out.transpose(1, 2).reshape(images, patches, -1))


class SiglipMLP(nn.Module):
    def __init__(self, arch: SiglipVisionArch) -> None:
        super().__init__()
        self.fc1 = nn.Linear(arch.hidden_size, arch.intermediate_size)
        self.fc2 = nn.Linear(arch.intermediate_size, arch.hidden_size)
        self.act = _activation(arch.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, arch: SiglipVisionArch) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(arch.hidden_size, eps=arch.layer_norm_eps)
        self.self_attn = SiglipAttention(arch)
        self.layer_norm2 = nn.LayerNorm(arch.hidden_size, eps=arch.layer_norm_eps)
        self.mlp = SiglipMLP(arch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, arch: SiglipVisionArch) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(arch) for _ in range(arch.num_hidden_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class SiglipVisionModel(nn.Module):
    """``pixel_values [images, C, H, W]`` -> ``[images, patches, hidden]``."""

    def __init__(self, arch: SiglipVisionArch) -> None:
        super().__init__()
        self.arch = arch
        self.embeddings = SiglipVisionEmbeddings(arch)
        self.encoder = SiglipEncoder(arch)
        self.post_layernorm = nn.LayerNorm(arch.hidden_size, eps=arch.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        size = self.arch.image_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (
            self.arch.num_channels,
            size,
            size,
        ):
            raise ValueError(
                f"pixel_values must be [images, {self.arch.num_channels}, {size}, {size}], "
                f"got {tuple(pixel_values.shape)}"
            )
        return self.post_layernorm(self.encoder(self.embeddings(pixel_values)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The tower's tensors by name; returns the names loaded. A missing or unexpected
        tensor, or a shape that differs, is an error."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("vision_model.")
            if name.startswith("head."):
                continue  # the pooling head: Gemma 3 uses the patch outputs
            if name not in params:
                raise ValueError(f"unexpected vision tower weight {name!r}")
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(
                    f"{name}: shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"vision tower weights missing: {missing[:4]}")
        return loaded
