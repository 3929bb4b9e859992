"""Tiny random checkpoints of the model families (Mixtral, Qwen3, Qwen3-MoE, DeepSeek-V2/V3,
Phi-3), built with transformers and saved as safetensors, without a tokenizer (the
engine runs them with ``skip_tokenizer_init``), plus HF greedy / logprob references."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

FAMILIES = ("mixtral", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3", "phi3")

_COMMON: dict[str, Any] = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)
# DeepSeek: layer 0 dense, layer 1 MoE with a shared expert; YaRN rope as released.
_DEEPSEEK: dict[str, Any] = dict(
    _COMMON,
    num_key_value_heads=4,
    moe_intermediate_size=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    first_k_dense_replace=1,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)


def _config(kind: str) -> Any:
    import transformers as tf

    if kind == "mixtral":
        return tf.MixtralConfig(**_COMMON, num_local_experts=8, num_experts_per_tok=2)
    if kind == "qwen3":
        return tf.Qwen3Config(**_COMMON, head_dim=16)
    if kind == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **_COMMON, head_dim=16, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, norm_topk_prob=True,
        )  # fmt: skip
    if kind == "deepseek_v2":  # softmax routing, no q compression, greedy top-k
        return tf.DeepseekV2Config(**_DEEPSEEK, q_lora_rank=None)
    if kind == "deepseek_v3":  # sigmoid + correction bias, group-limited, q_lora
        return tf.DeepseekV3Config(
            **_DEEPSEEK, q_lora_rank=24, n_group=4, topk_group=2, routed_scaling_factor=2.5
        )
    if kind == "phi3":
        return tf.Phi3Config(**_COMMON)
    raise ValueError(kind)


def build_family_model(kind: str, directory: Path) -> Any:
    """Save a tiny random ``kind`` checkpoint (no tokenizer) to ``directory``; returns
    the HF model in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(kind)).float().eval()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            # HF zero-initialises biases and V3's expert correction bias: make them matter.
            if name.endswith(".bias") or "e_score_correction_bias" in name:
                tensor.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    return model


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens: list[int] = []
    for _ in range(max_tokens):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
    return tokens


@torch.inference_mode()
def hf_log_softmax(model: Any, token_ids: list[int]) -> torch.Tensor:
    """Row ``i``: the distribution of the token after position ``i``."""
    return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)
