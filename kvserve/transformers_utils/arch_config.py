"""The handful of architecture numbers the engine needs, read from GGUF or config.json.

Both formats are normalised into one frozen ``ArchConfig`` so the model code, the KV
cache sizing and the scheduler never care where a model came from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvserve.transformers_utils.arch_families import MLAConfig, MoEConfig, family_fields
from kvserve.transformers_utils.gguf_reader import GGUFFile, GGUFTensor, open_gguf
from kvserve.transformers_utils.mamba_arch import (
    MAMBA,
    MLP,
    PARALLEL_HYBRID,
    MambaArch,
    MupMultipliers,
    mamba_fields,
    normalise_mamba_config,
)
from kvserve.transformers_utils.model_resolver import ResolvedModel
from kvserve.transformers_utils.multimodal_arch import (
    ENCODER_DECODER_ARCHITECTURES,
    VLM_ARCHITECTURES,
    MultiModalArch,
    gemma3_multimodal,
    whisper_multimodal,
)
from kvserve.utils.startup import startup_phase

# Bidirectional encoders (pooling only): no causal mask, no LM head.
ENCODER_ONLY_ARCHITECTURES = ("BertModel",)
_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# HF's per-layer attention kinds (``config.layer_types``).
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
CHUNKED_ATTENTION = "chunked_attention"
# MAMBA: a Mamba-2 mixer with a recurrent state instead of attention, MLP: a
# feed-forward-only layer of a hybrid, PARALLEL_HYBRID: a Mamba-2 mixer beside full
# attention (mamba_arch.py).
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION, CHUNKED_ATTENTION, MAMBA, MLP, PARALLEL_HYBRID)
# llama.cpp's Gemma 3 files carry no pattern key: every 6th layer is global, as in HF's
# Gemma3TextConfig default (``sliding_window_pattern=6``).
_GEMMA3_SLIDING_PATTERN = 6


@dataclass(frozen=True)
class ArchConfig:
    """Architecture hyper-parameters. ``rope_scaling`` uses HF keys (``rope_type``,
    ``factor``, ...) and is None for plain RoPE; GGUF llama-3 files, which store
    precomputed per-frequency divisors, use ``{"rope_type": "freq_factors",
    "freq_factors": [...]}``.

    Attention differs per layer: ``layer_types[i]`` is HF's kind of layer ``i``
    (``full_attention``, ``sliding_attention`` over the last ``sliding_window`` tokens,
    ``chunked_attention`` within aligned chunks of ``attention_chunk_size``); an empty
    tuple is filled in (every layer sliding when ``sliding_window`` is set, else full).
    ``query_pre_attn_scalar`` replaces ``head_dim`` in the ``1/sqrt`` score scale where
    set; ``rope_local_base_freq`` is the RoPE base of sliding layers where it differs
    (Gemma 3). The soft-caps are ``cap * tanh(x / cap)`` on attention scores and on the
    final logits. ``moe``, ``mla`` and ``qk_norm`` describe the families of
    ``arch_families`` (None / False for dense Llama-like models).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    attention_chunk_size: int | None = None
    query_pre_attn_scalar: float | None = None
    rope_local_base_freq: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    qk_norm: bool = False
    # BERT's token type (segment) embeddings; 0 for models without them.
    type_vocab_size: int = 0
    # Vision-language models: the vision side (None for text-only models).
    multimodal: MultiModalArch | None = None
    # Mamba-2 mixers (the layers whose layer_types entry is "mamba"); None without.
    mamba: MambaArch | None = None
    # FalconH1's muP multipliers (Granite's scalars too); None for models without.
    mup: MupMultipliers | None = None
    # Attention without RoPE (GraniteMoeHybrid's position_embedding_type "nope").
    no_rope: bool = False

    @property
    def is_encoder_only(self) -> bool:
        return self.architecture in ENCODER_ONLY_ARCHITECTURES

    def __post_init__(self) -> None:
        if not self.layer_types:
            kind = FULL_ATTENTION if self.sliding_window is None else SLIDING_ATTENTION
            object.__setattr__(self, "layer_types", (kind,) * self.num_hidden_layers)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers"
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"unsupported layer_types {unknown} (supported: {LAYER_TYPES})")
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has sliding_attention layers but no sliding_window")
        if {MAMBA, PARALLEL_HYBRID} & set(self.layer_types) and self.mamba is None:
            raise ValueError("layer_types has mamba layers but no mamba config")
        if CHUNKED_ATTENTION in self.layer_types and not self.attention_chunk_size:
            raise ValueError("layer_types has chunked_attention layers but no attention_chunk_size")

    def layer_sliding_window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None

    def layer_chunk_size(self, layer: int) -> int | None:
        is_chunked = self.layer_types[layer] == CHUNKED_ATTENTION
        return self.attention_chunk_size if is_chunked else None

    def layer_rope_theta(self, layer: int) -> float:
        local = self.rope_local_base_freq
        is_local = self.layer_types[layer] == SLIDING_ATTENTION and local is not None
        return local if is_local and local is not None else self.rope_theta


def load_arch_config(resolved: ResolvedModel) -> ArchConfig:
    with startup_phase("model config", format=resolved.format):
        if resolved.format == "gguf":
            return _from_gguf(resolved.path)
        return _from_hf_dir(Path(resolved.path))


# ---------------------------------------------------------------- GGUF


def _gguf_value(reader: GGUFFile, key: str, default: Any = None) -> Any:
    value = reader.get(key)
    if value is None:
        return default
    return value.tolist() if isinstance(value, np.ndarray) else value


def _from_gguf(path: str) -> ArchConfig:
    reader = open_gguf(path)
    gguf_arch = _gguf_value(reader, "general.architecture")
    if gguf_arch not in _GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {gguf_arch!r} "
            f"(supported: {', '.join(_GGUF_ARCHITECTURES)}) in {path}"
        )

    def meta(key: str, default: Any = None) -> Any:
        value = _gguf_value(reader, f"{gguf_arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF file {path} lacks metadata key {gguf_arch}.{key}")
        return value

    tensors = {t.name: t for t in reader.tensors}
    hidden = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // num_heads))
    vocab = _gguf_value(reader, f"{gguf_arch}.vocab_size")
    if vocab is None:  # older converters only wrote the token list
        vocab = int(tensors["token_embd.weight"].shape[-1])
    eos_ids = [_gguf_value(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    num_layers = int(meta("block_count"))
    families = _gguf_family_fields(reader, gguf_arch)
    architecture = _GGUF_ARCHITECTURES[gguf_arch]
    if gguf_arch == "llama" and "moe" in families:  # llama.cpp files Mixtral as llama
        architecture = "MixtralForCausalLM"
    return ArchConfig(
        architecture=architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(reader, gguf_arch, tensors),
        max_position_embeddings=int(meta("context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        # Qwen2 always has q/k/v biases; llama GGUFs may carry them too.
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=_gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
        **_gguf_attention_variants(reader, gguf_arch, num_layers, head_dim),
        **families,
    )


def _gguf_family_fields(reader: GGUFFile, arch: str) -> dict[str, Any]:
    """Qwen3's q/k norms and the experts of MoE files (Mixtral as ``llama``, Qwen3-MoE)."""
    fields: dict[str, Any] = {}
    if arch in ("qwen3", "qwen3moe"):
        fields["qk_norm"] = True
    num_experts = _gguf_value(reader, f"{arch}.expert_count")
    if num_experts:
        expert_ffn = _gguf_value(reader, f"{arch}.expert_feed_forward_length")
        fields["moe"] = MoEConfig(
            num_experts=int(num_experts),
            top_k=int(_gguf_value(reader, f"{arch}.expert_used_count")),
            intermediate_size=int(expert_ffn or _gguf_value(reader, f"{arch}.feed_forward_length")),
            # llama.cpp renormalises the chosen weights for both (its norm_w).
            renormalize=True,
        )
    return fields


def _gguf_attention_variants(
    reader: GGUFFile, arch: str, num_layers: int, head_dim: int
) -> dict[str, Any]:
    """Per-layer window and Gemma's scalars; llama and qwen2 files have none."""
    if arch != "gemma3":
        return {}
    pattern = _gguf_value(reader, f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # newer converters: one bool per layer, True = sliding
        sliding = [bool(p) for p in pattern]
    else:
        period = int(pattern or _GEMMA3_SLIDING_PATTERN)
        sliding = [(i + 1) % period != 0 for i in range(num_layers)]
    return {
        "sliding_window": int(_gguf_value(reader, f"{arch}.attention.sliding_window")),
        "layer_types": tuple(SLIDING_ATTENTION if s else FULL_ATTENTION for s in sliding),
        # The converter folds neither value into the file: HF's defaults apply (Gemma 3
        # scales scores by head_dim, its local layers use base 10000).
        "query_pre_attn_scalar": float(head_dim),
        "rope_local_base_freq": 10000.0,
        # HF's Gemma 3 (the reference) never soft-caps attention scores; see
        # _gemma3_variants.
        "attn_logit_softcapping": None,
        "final_logit_softcapping": _gguf_value(reader, f"{arch}.final_logit_softcapping"),
    }


def _gguf_rope_scaling(
    reader: GGUFFile, arch: str, tensors: dict[str, GGUFTensor]
) -> dict[str, Any] | None:
    if "rope_freqs.weight" in tensors:
        # llama.cpp bakes llama3 scaling into a tensor of divisors for inv_freq.
        factors = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float32)
        return {"rope_type": "freq_factors", "freq_factors": factors.tolist()}
    kind = _gguf_value(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise ValueError(f"unsupported GGUF rope scaling type {kind!r} (supported: linear)")
    return {
        "rope_type": "linear",
        "factor": float(_gguf_value(reader, f"{arch}.rope.scaling.factor")),
    }


# ---------------------------------------------------------------- config.json


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read model config {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"model config {path} is not a JSON object")
    return data


def _normalise_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers 5 folds rope_theta into `rope_parameters`; 4.x had `rope_theta` at
    # the top level and `rope_scaling` (keyed `type` in very old configs).
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if FULL_ATTENTION in params:  # per layer kind (Gemma 3): the global layers' entry
        params = dict(params[FULL_ATTENTION] or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in ("llama3", "linear", "yarn"):
        raise ValueError(
            f"unsupported rope_type {rope_type!r} (supported: default, llama3, linear, yarn)"
        )
    if rope_type == "yarn":  # factor may be implied by the context extension (DeepSeek-V3)
        params.setdefault("max_position_embeddings", cfg.get("max_position_embeddings"))
    return theta, {"rope_type": rope_type, **params}


def _eos_ids(*values: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for value in values:
        if value is None:
            continue
        ids.extend(value if isinstance(value, list) else [value])
    return tuple(dict.fromkeys(int(i) for i in ids))


def _from_hf_dir(model_dir: Path) -> ArchConfig:
    config_path = model_dir / "config.json"
    cfg = _read_json(config_path)
    architectures = cfg.get("architectures") or []
    if not architectures:
        raise ValueError(f"{config_path} lists no architectures")
    # Whether kvserve has a model for it is the model registry's question (an
    # out-of-tree model may be registered under any name).
    arch = str(architectures[0])
    cfg = normalise_mamba_config(arch, cfg)
    multimodal = None
    gen_path = model_dir / "generation_config.json"
    generation = _read_json(gen_path) if gen_path.is_file() else {}
    if arch in ENCODER_DECODER_ARCHITECTURES:
        multimodal, cfg = whisper_multimodal(cfg, generation)
    elif arch in VLM_ARCHITECTURES:
        multimodal = gemma3_multimodal(cfg)
        # The text numbers are the language model's.
        text = cfg["text_config"]
        # HF ties the head by the top-level flag; the text config's may be a default.
        tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
        cfg = {**cfg, **text, "tie_word_embeddings": tie}
    gen_eos = generation.get("eos_token_id")
    try:
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        theta, scaling = _normalise_rope(cfg)
        num_layers = int(cfg["num_hidden_layers"])
        return ArchConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            # Llama 4's dense layers use intermediate_size_mlp (intermediate_size is MoE's).
            intermediate_size=int(cfg.get("intermediate_size_mlp") or cfg["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", cfg.get("layer_norm_eps", 1e-6))),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_ids(cfg.get("eos_token_id"), gen_eos),
            **_hf_attention_variants(arch, cfg, num_layers),
            **family_fields(arch, cfg),
            **mamba_fields(arch, cfg),
            multimodal=multimodal,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"invalid model config {config_path}: {e!r}") from e


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _hf_attention_variants(arch: str, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Per-layer attention kinds and Gemma's scalars from a config.json."""
    if arch in ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"):
        return _gemma3_variants(cfg, num_layers)
    if arch == "Llama4ForCausalLM":
        return _llama4_variants(cfg, num_layers)
    if arch == "BertModel":
        return _bert_variants(cfg)
    use_window = cfg.get("use_sliding_window", arch != "Qwen2ForCausalLM")
    window = cfg.get("sliding_window") if use_window else None
    return {"sliding_window": None if window is None else int(window)}


def _bert_variants(cfg: dict[str, Any]) -> dict[str, Any]:
    """BERT: LayerNorm's eps stands in rms_norm_eps; absolute positions, exact GELU."""
    if cfg.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"unsupported BERT hidden_act {cfg.get('hidden_act')!r} (gelu only)")
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError("only absolute position embeddings are supported for BERT")
    return {"type_vocab_size": int(cfg.get("type_vocab_size", 2))}


def _gemma3_variants(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"unsupported Gemma 3 hidden_activation {activation!r}")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with use_bidirectional_attention is not a causal LM")
    layer_types = cfg.get("layer_types")
    if not layer_types:  # older configs: an int period, every period-th layer global
        period = int(cfg.get("sliding_window_pattern") or _GEMMA3_SLIDING_PATTERN)
        layer_types = [
            SLIDING_ATTENTION if (i + 1) % period else FULL_ATTENTION for i in range(num_layers)
        ]
    rope = cfg.get("rope_parameters") or {}
    local = (rope.get(SLIDING_ATTENTION) or {}).get("rope_theta")
    return {
        "sliding_window": int(cfg.get("sliding_window") or 4096),
        "layer_types": tuple(layer_types),
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or 256),
        "rope_local_base_freq": float(local or cfg.get("rope_local_base_freq") or 10000.0),
        # HF's Gemma3Attention keeps attn_logit_softcapping but never passes it to the
        # attention function (transformers 5.x), so a config that sets it must not change
        # the scores: capping them here flipped greedy tokens against HF.
        "attn_logit_softcapping": None,
        "final_logit_softcapping": _optional_float(cfg.get("final_logit_softcapping")),
    }


def _llama4_variants(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Llama 4 text, dense layers only: chunked local attention on every RoPE layer."""
    unsupported = {
        "moe_layers": bool(cfg.get("moe_layers")),
        "no_rope_layers": 0 in (cfg.get("no_rope_layers") or []),
        "use_qk_norm": bool(cfg.get("use_qk_norm")),
    }
    named = [name for name, used in unsupported.items() if used]
    if named:
        raise ValueError(f"Llama 4 features not supported yet: {named}")
    chunk = cfg.get("attention_chunk_size")
    kind = FULL_ATTENTION if chunk is None else CHUNKED_ATTENTION
    return {
        "layer_types": (kind,) * num_layers,
        "attention_chunk_size": None if chunk is None else int(chunk),
    }
