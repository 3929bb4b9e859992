"""Tiny random Mamba-2 checkpoints built with transformers (pure ``Mamba2ForCausalLM``,
the ``BambaForCausalLM``, ``NemotronHForCausalLM``, ``FalconH1ForCausalLM`` and
``GraniteMoeHybridForCausalLM`` hybrids),
saved without a tokenizer, plus HF references.

Shapes are chosen so prompts of a few dozen tokens cross the scan's chunks (chunk_size
8) and, in the hybrid, the state pads up to an attention page."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

MAMBA_FAMILIES = ("mamba2", "bamba", "nemotron_h", "falcon_h1", "granitemoehybrid")

_COMMON: dict[str, Any] = dict(
    vocab_size=160,
    hidden_size=32,
    num_hidden_layers=3,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)


def _config(kind: str) -> Any:
    import transformers as tf

    if kind == "mamba2":
        return tf.Mamba2Config(
            **_COMMON, num_heads=8, head_dim=8, state_size=8, n_groups=2, expand=2,
            conv_kernel=4, chunk_size=8, use_conv_bias=True,
        )  # fmt: skip
    if kind == "bamba":
        return tf.BambaConfig(
            **_COMMON, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2,
            mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
            max_position_embeddings=512,
        )  # fmt: skip
    if kind == "nemotron_h":
        # The legacy pattern string (Mamba, attention, MLP, Mamba); HF turns it into
        # layers_block_type. Its heads x head_dim (64) differ from expand x hidden.
        common = {**_COMMON, "num_hidden_layers": 4}
        return tf.NemotronHConfig(
            **common, hybrid_override_pattern="M*-M", intermediate_size=48,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, mamba_num_heads=8,
            mamba_head_dim=8, n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=8,
            expand=4, max_position_embeddings=512,
        )  # fmt: skip
    if kind == "falcon_h1":
        # Every muP multiplier away from 1 and biases on (they fold into the weights);
        # the gated norm before the gate.
        return tf.FalconH1Config(
            **_COMMON, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            mamba_d_ssm=64, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=8,
            mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, mamba_rms_norm=True,
            mamba_norm_before_gate=True, attention_bias=True, projectors_bias=True,
            max_position_embeddings=512, embedding_multiplier=2.0, lm_head_multiplier=0.5,
            key_multiplier=0.7, attention_in_multiplier=1.3, attention_out_multiplier=0.8,
            ssm_in_multiplier=1.2, ssm_out_multiplier=0.9,
            ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.5], mlp_multipliers=[1.3, 0.7],
        )  # fmt: skip
    if kind == "granitemoehybrid":
        # Routed experts beside the shared MLP, Granite's scalars away from 1, RoPE on.
        return tf.GraniteMoeHybridConfig(
            **_COMMON, intermediate_size=24, shared_intermediate_size=40,
            num_local_experts=4, num_experts_per_tok=2, num_attention_heads=4,
            num_key_value_heads=2, layer_types=["mamba", "attention", "mamba"],
            mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=8,
            mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, max_position_embeddings=512,
            position_embedding_type="rope", embedding_multiplier=2.0, logits_scaling=2.0,
            residual_multiplier=0.6, attention_multiplier=0.4,
        )  # fmt: skip
    raise ValueError(kind)


def build_mamba_model(kind: str, directory: Path) -> Any:
    """Save a tiny random ``kind`` checkpoint (no tokenizer) to ``directory``; returns
    the HF model in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(kind)).float().eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            # HF zero-initialises biases and the norms to one: make them matter.
            if name.endswith(".bias") or name.endswith("norm.weight"):
                tensor.normal_(0.0 if name.endswith(".bias") else 1.0, 0.1)
            if name.endswith("dt_bias"):  # dt around 1: states decay and mix visibly
                tensor.normal_(0.5, 0.3)
    model.save_pretrained(directory)
    return model


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """HF's own greedy generation (its recurrent cache for Mamba layers), going on past
    EOS as ``ignore_eos`` does: generate stops at EOS, so it is called again on what it
    has (``min_new_tokens`` would instead forbid EOS, changing the argmax)."""
    tokens = list(prompt)
    while len(tokens) < len(prompt) + max_tokens:
        out = model.generate(
            torch.tensor([tokens]), max_new_tokens=len(prompt) + max_tokens - len(tokens),
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
        tokens = [int(t) for t in out[0]]
    return tokens[len(prompt) :]
