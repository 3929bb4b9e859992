"""Tiny random Mamba-2 checkpoints built with transformers (pure ``Mamba2ForCausalLM``,
the ``BambaForCausalLM`` and ``NemotronHForCausalLM`` hybrids), saved without a
tokenizer, plus HF references.

Shapes are chosen so prompts of a few dozen tokens cross the scan's chunks (chunk_size
8) and, in the hybrid, the state pads up to an attention page."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

MAMBA_FAMILIES = ("mamba2", "bamba", "nemotron_h")

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
    """HF's own greedy generation (its recurrent cache for Mamba layers)."""
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
        min_new_tokens=max_tokens, pad_token_id=0,
    )  # fmt: skip
    return [int(t) for t in out[0, len(prompt) :]]
