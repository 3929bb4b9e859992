from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from kvserve.transformers_utils.arch_config import load_arch_config
from kvserve.transformers_utils.model_resolver import resolve_model

LLAMA3_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008],
}
LLAMA3_ROPE = {
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _hf_dir(tmp_path: Path, config: dict, generation: dict | None = None) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def test_smollm2_gguf_config() -> None:
    arch = load_arch_config(resolve_model(None))
    assert arch.architecture == "LlamaForCausalLM"
    assert (arch.hidden_size, arch.num_hidden_layers, arch.vocab_size) == (576, 30, 49152)
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (9, 3, 64)
    assert arch.rope_theta == 100000.0 and arch.rope_scaling is None
    assert arch.tie_word_embeddings and not arch.attention_bias
    assert (arch.bos_token_id, arch.eos_token_ids) == (1, (2,))


@pytest.mark.parametrize("style", ["transformers5", "transformers4", "legacy_type_key"])
def test_llama3_rope_in_all_config_styles(tmp_path: Path, style: str) -> None:
    config = dict(LLAMA3_CONFIG)
    if style == "transformers5":
        config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_ROPE}
    else:
        key = "rope_type" if style == "transformers4" else "type"
        config["rope_theta"] = 500000.0
        config["rope_scaling"] = {key: "llama3", **LLAMA3_ROPE}
    arch = load_arch_config(resolve_model(str(_hf_dir(tmp_path, config, {"eos_token_id": 128009}))))
    assert arch.rope_theta == 500000.0
    assert arch.rope_scaling == {"rope_type": "llama3", **LLAMA3_ROPE}
    assert arch.head_dim == 64
    assert arch.eos_token_ids == (128001, 128008, 128009)
    assert arch.sliding_window is None


def test_qwen2_has_qkv_bias_and_no_window(tmp_path: Path) -> None:
    config = dict(LLAMA3_CONFIG, architectures=["Qwen2ForCausalLM"], sliding_window=4096)
    config["use_sliding_window"] = False
    arch = load_arch_config(resolve_model(str(_hf_dir(tmp_path, config))))
    assert arch.architecture == "Qwen2ForCausalLM"
    assert arch.attention_bias and arch.sliding_window is None and arch.rope_scaling is None


@pytest.mark.parametrize(
    ("config_text", "match"),
    [
        ("{not json", "cannot read model config"),
        ("[]", "not a JSON object"),
        # Whether an architecture is supported is the model registry's question
        # (tests/model_executor/models/test_registry.py).
        (json.dumps({"vocab_size": 3}), "lists no architectures"),
        (json.dumps({**LLAMA3_CONFIG, "hidden_act": "gelu"}), "unsupported hidden_act"),
        (json.dumps({k: v for k, v in LLAMA3_CONFIG.items() if k != "hidden_size"}), "hidden_size"),
        (json.dumps({**LLAMA3_CONFIG, "rope_scaling": {"rope_type": "longrope", "factor": 2}}), "unsupported rope_type"),
    ],
)  # fmt: skip
def test_bad_config_json(tmp_path: Path, config_text: str, match: str) -> None:
    (tmp_path / "config.json").write_text(config_text)
    with pytest.raises(ValueError, match=match):
        load_arch_config(resolve_model(str(tmp_path)))


def _write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-6)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    _write_gguf(path, "gpt2", {"token_embd.weight": np.zeros((4, 8), np.float32)})
    with pytest.raises(
        ValueError,
        match=r"unsupported GGUF architecture 'gpt2' \(supported: llama, qwen2, qwen3, qwen3moe, gemma3\)",
    ):
        load_arch_config(resolve_model(str(path)))


def test_qwen2_gguf_bias_untied_and_rope_freqs(tmp_path: Path) -> None:
    path = tmp_path / "q.gguf"
    tensors = {
        "token_embd.weight": np.zeros((32, 8), np.float32),
        "output.weight": np.zeros((32, 8), np.float32),
        "blk.0.attn_q.bias": np.zeros(8, np.float32),
        "rope_freqs.weight": np.array([1.0, 8.0], np.float32),
    }
    _write_gguf(path, "qwen2", tensors)
    arch = load_arch_config(resolve_model(str(path)))
    assert arch.architecture == "Qwen2ForCausalLM"
    assert arch.vocab_size == 32  # from the embedding: no qwen2.vocab_size key
    assert arch.attention_bias and not arch.tie_word_embeddings
    assert (arch.num_key_value_heads, arch.head_dim) == (2, 4)
    assert arch.rope_scaling == {"rope_type": "freq_factors", "freq_factors": [1.0, 8.0]}


GEMMA3_CONFIG = {
    "architectures": ["Gemma3ForCausalLM"],
    "vocab_size": 262144,
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "sliding_window": 512,
    "query_pre_attn_scalar": 256,
    "tie_word_embeddings": True,
}


def test_gemma3_transformers4_style_config(tmp_path: Path) -> None:
    """Hub configs of transformers 4: a pattern int, rope_theta and rope_local_base_freq."""
    config = dict(GEMMA3_CONFIG, sliding_window_pattern=4, rope_theta=1e6, rope_local_base_freq=1e4)
    arch = load_arch_config(resolve_model(str(_hf_dir(tmp_path, config))))
    kinds = ["sliding_attention"] * 3 + ["full_attention"]
    assert arch.layer_types == tuple(kinds * 2)
    assert (arch.rope_theta, arch.rope_local_base_freq) == (1e6, 1e4)
    assert [arch.layer_rope_theta(i) for i in (0, 3)] == [1e4, 1e6]
    assert [arch.layer_sliding_window(i) for i in (0, 3)] == [512, None]


def test_gemma3_transformers5_style_config(tmp_path: Path) -> None:
    config = dict(
        GEMMA3_CONFIG,
        layer_types=["full_attention", "sliding_attention"] * 4,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    )
    arch = load_arch_config(resolve_model(str(_hf_dir(tmp_path, config))))
    assert arch.layer_types[:2] == ("full_attention", "sliding_attention")
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    # HF's Gemma 3 ignores attn_logit_softcapping (its attention never receives it), and
    # HF is the reference: applying it flipped greedy tokens of a tiny random model.
    assert (arch.attn_logit_softcapping, arch.final_logit_softcapping) == (None, 30.0)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"hidden_activation": "relu"}, "hidden_activation"),
        ({"layer_types": ["full_attention"] * 7}, "layer_types has 7 entries"),
        ({"layer_types": ["mystery"] * 8}, "unsupported layer_types"),
    ],
)
def test_gemma3_bad_configs_are_refused(tmp_path: Path, extra: dict, match: str) -> None:
    config = _hf_dir(tmp_path, dict(GEMMA3_CONFIG, **extra))
    with pytest.raises(ValueError, match=match):
        load_arch_config(resolve_model(str(config)))


def test_llama4_moe_is_refused(tmp_path: Path) -> None:
    config = dict(LLAMA3_CONFIG, architectures=["Llama4ForCausalLM"], moe_layers=[1])
    with pytest.raises(ValueError, match="moe_layers"):
        load_arch_config(resolve_model(str(_hf_dir(tmp_path, config))))


def test_mistral_window_applies_to_every_layer(tmp_path: Path) -> None:
    config = dict(LLAMA3_CONFIG, architectures=["MistralForCausalLM"], sliding_window=4096)
    arch = load_arch_config(resolve_model(str(_hf_dir(tmp_path, config))))
    assert arch.layer_types == ("sliding_attention",) * 16
    assert arch.layer_sliding_window(15) == 4096
