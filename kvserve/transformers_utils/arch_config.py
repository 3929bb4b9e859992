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

from kvserve.transformers_utils.gguf_reader import GGUFFile, GGUFTensor, open_gguf
from kvserve.transformers_utils.model_resolver import ResolvedModel
from kvserve.utils.startup import startup_phase

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass(frozen=True)
class ArchConfig:
    """Architecture hyper-parameters. ``rope_scaling`` uses HF keys (``rope_type``,
    ``factor``, ...) and is None for plain RoPE; GGUF llama-3 files, which store
    precomputed per-frequency divisors, use ``{"rope_type": "freq_factors",
    "freq_factors": [...]}``."""

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
    vocab = _gguf_value(reader, f"{gguf_arch}.vocab_size")
    if vocab is None:  # older converters only wrote the token list
        vocab = int(tensors["token_embd.weight"].shape[-1])
    eos_ids = [_gguf_value(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return ArchConfig(
        architecture=_GGUF_ARCHITECTURES[gguf_arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=int(meta("attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(reader, gguf_arch, tensors),
        max_position_embeddings=int(meta("context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        # Qwen2 always has q/k/v biases; llama GGUFs may carry them too.
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=_gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
        sliding_window=None,
    )


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
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in ("llama3", "linear"):
        raise ValueError(
            f"unsupported rope_type {rope_type!r} (supported: default, llama3, linear)"
        )
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
    arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"unsupported architectures {architectures!r} in {config_path} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    gen_path = model_dir / "generation_config.json"
    gen_eos = _read_json(gen_path).get("eos_token_id") if gen_path.is_file() else None
    try:
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        theta, scaling = _normalise_rope(cfg)
        use_window = cfg.get("use_sliding_window", arch != "Qwen2ForCausalLM")
        return ArchConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_ids(cfg.get("eos_token_id"), gen_eos),
            sliding_window=cfg.get("sliding_window") if use_window else None,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"invalid model config {config_path}: {e!r}") from e
