"""Whisper (``WhisperForConditionalGeneration``): a log-mel audio encoder and a text
decoder that attends to the encoder's output through cross-attention.

The model runner drives it in two parts: ``embed_multimodal`` runs the encoder on one
request's log-mel features ``[num_mel_bins, 2 * max_source_positions]`` (the runner's
encoder cache keeps the output by the audio's hash, so the same audio is encoded once);
``forward`` runs the decoder over the step's flattened tokens. Its self-attention is the
paged causal ``Attention``; its cross-attention layers (``CrossAttention``) take the
encoder outputs of the requests that start in this step, write their K/V into the
requests' cross-attention blocks, and read them there in every later step.

As HF's: pre-LayerNorm blocks, learned decoder positions, sinusoidal encoder positions
(stored in the checkpoint), q scaled before the product (scale 1 in the attention), no
bias on k_proj, and the output projection tied to the token embeddings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention.cross_attention import CrossAttention
from kvserve.attention.layer import Attention
from kvserve.transformers_utils.arch_config import ArchConfig

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "relu": F.relu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported Whisper activation_function {name!r}")
    return _ACTIVATIONS[name]


class _Projections(nn.Module):
    """q/k/v/out projections with HF's names (k_proj has no bias)."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_proj(x) * self.scaling


class WhisperEncoderAttention(_Projections):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [L, d]`` -> ``[L, d]``, every position seeing every other."""
        n = x.shape[0]

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, self.num_heads, self.head_dim).transpose(0, 1)

        out = F.scaled_dot_product_attention(
            heads(self.query(x)), heads(self.k_proj(x)), heads(self.v_proj(x)), scale=1.0
        )
        return self.out_proj(out.transpose(0, 1).reshape(n, -1))


class WhisperDecoderSelfAttention(_Projections):
    def __init__(self, d_model: int, num_heads: int, layer_name: str) -> None:
        super().__init__(d_model, num_heads)
        self.attn = Attention(num_heads, self.head_dim, 1.0, num_heads, layer_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.attn(self.query(x), self.k_proj(x), self.v_proj(x)))


class WhisperCrossAttention(_Projections):
    def __init__(self, d_model: int, num_heads: int, layer_name: str, encoder_len: int) -> None:
        super().__init__(d_model, num_heads)
        self.attn = CrossAttention(
            num_heads, self.head_dim, 1.0, num_heads, layer_name, encoder_len
        )

    def forward(self, x: torch.Tensor, encoder_states: torch.Tensor | None) -> torch.Tensor:
        k = v = None
        if encoder_states is not None:
            k, v = self.k_proj(encoder_states), self.v_proj(encoder_states)
        return self.out_proj(self.attn(self.query(x), k, v))


class _MLP(nn.Module):
    def __init__(self, d_model: int, ffn_dim: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, d_model)
        self.act = _activation(act)


class WhisperEncoderLayer(_MLP):
    def __init__(self, d_model: int, heads: int, ffn_dim: int, act: str) -> None:
        super().__init__(d_model, ffn_dim, act)
        self.self_attn = WhisperEncoderAttention(d_model, heads)
        self.self_attn_layer_norm = nn.LayerNorm(d_model)
        self.final_layer_norm = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class WhisperDecoderLayer(_MLP):
    def __init__(
        self, d_model: int, heads: int, ffn_dim: int, act: str, index: int, encoder_len: int
    ) -> None:
        super().__init__(d_model, ffn_dim, act)
        prefix = f"model.decoder.layers.{index}"
        self.self_attn = WhisperDecoderSelfAttention(d_model, heads, f"{prefix}.self_attn")
        self.self_attn_layer_norm = nn.LayerNorm(d_model)
        self.encoder_attn = WhisperCrossAttention(
            d_model, heads, f"{prefix}.encoder_attn", encoder_len
        )
        self.encoder_attn_layer_norm = nn.LayerNorm(d_model)
        self.final_layer_norm = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor, encoder_states: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        x = x + self.encoder_attn(self.encoder_attn_layer_norm(x), encoder_states)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class WhisperEncoder(nn.Module):
    def __init__(self, cfg: dict[str, object], d_model: int, act: str) -> None:
        super().__init__()
        num_mel_bins = int(cfg.get("num_mel_bins", 80))  # type: ignore[call-overload]
        self.max_source_positions = int(cfg["max_source_positions"])  # type: ignore[call-overload]
        heads = int(cfg["encoder_attention_heads"])  # type: ignore[call-overload]
        ffn = int(cfg["encoder_ffn_dim"])  # type: ignore[call-overload]
        num_layers = int(cfg["encoder_layers"])  # type: ignore[call-overload]
        self.num_mel_bins = num_mel_bins
        self.conv1 = nn.Conv1d(num_mel_bins, d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d_model, d_model, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(self.max_source_positions, d_model)
        self.layers = nn.ModuleList(
            WhisperEncoderLayer(d_model, heads, ffn, act) for _ in range(num_layers)
        )
        self.layer_norm = nn.LayerNorm(d_model)
        self.act = _activation(act)

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        """``[num_mel_bins, 2 * max_source_positions]`` -> ``[max_source_positions, d]``."""
        expected = (self.num_mel_bins, 2 * self.max_source_positions)
        if tuple(input_features.shape) != expected:
            raise ValueError(f"Whisper input features {tuple(input_features.shape)} != {expected}")
        x = self.act(self.conv1(input_features[None]))
        x = self.act(self.conv2(x))[0].transpose(0, 1)
        x = x + self.embed_positions.weight
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class WhisperDecoder(nn.Module):
    def __init__(self, arch: ArchConfig, cfg: dict[str, object], act: str) -> None:
        super().__init__()
        d = arch.hidden_size
        encoder_len = int(cfg["max_source_positions"])  # type: ignore[call-overload]
        self.embed_tokens = nn.Embedding(arch.vocab_size, d)
        self.embed_positions = nn.Embedding(arch.max_position_embeddings, d)
        self.layers = nn.ModuleList(
            WhisperDecoderLayer(
                d, arch.num_attention_heads, arch.intermediate_size, act, i, encoder_len
            )
            for i in range(arch.num_hidden_layers)
        )
        self.layer_norm = nn.LayerNorm(d)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, encoder_states: torch.Tensor | None
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids) + self.embed_positions(positions)
        for layer in self.layers:
            x = layer(x, encoder_states)
        return self.layer_norm(x)


class WhisperModel(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        if arch.multimodal is None or not arch.multimodal.encoder_decoder:
            raise ValueError("WhisperForConditionalGeneration needs its encoder config")
        cfg = arch.multimodal.vision_config
        if cfg.get("scale_embedding"):
            raise ValueError("Whisper with scale_embedding=True is not supported")
        act = str(cfg.get("activation_function", "gelu"))
        self.encoder = WhisperEncoder(cfg, arch.hidden_size, act)
        self.decoder = WhisperDecoder(arch, cfg, act)


class WhisperForConditionalGeneration(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.arch = arch
        self.model = WhisperModel(arch)

    def embed_multimodal(self, input_features: torch.Tensor) -> torch.Tensor:
        """One request's log-mel features ``[1, mels, frames]`` or ``[mels, frames]``
        -> the encoder output ``[max_source_positions, d_model]``."""
        features = input_features.reshape(input_features.shape[-2:])
        return self.model.encoder(features.to(self.model.encoder.conv1.weight.dtype))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        encoder_outputs: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``encoder_outputs``: those of the rows that start in this step, in row order."""
        states = torch.cat(encoder_outputs) if encoder_outputs else None
        return self.model.decoder(input_ids, positions, states)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states, self.model.decoder.embed_tokens.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "proj_out.weight":
                continue  # tied to model.decoder.embed_tokens
            param = params.get(name)
            if param is None:
                raise ValueError(f"unexpected Whisper weight {name!r}")
            if param.shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"Whisper checkpoint lacks {missing[:5]}")
        return loaded
