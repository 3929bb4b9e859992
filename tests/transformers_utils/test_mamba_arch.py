"""The Mamba config readers on config.json dicts: NemotronH's block pattern in its
spellings (transformers 5's ``layers_block_type``, the released checkpoints'
``hybrid_override_pattern`` and their older names), and what is refused by name."""

from __future__ import annotations

from typing import Any

import pytest

from kvserve.transformers_utils.mamba_arch import (
    MAMBA,
    MLP,
    PARALLEL_HYBRID,
    mamba_fields,
    normalise_mamba_config,
)

_ARCH = "NemotronHForCausalLM"


def _nemotron_h(**overrides: Any) -> dict[str, Any]:
    # The names NVIDIA's released configs use (mamba_* before transformers 5's renames).
    return {
        "hidden_size": 64, "num_attention_heads": 4, "mamba_num_heads": 4,
        "mamba_head_dim": 32, "ssm_state_size": 16, "mamba_n_groups": 2, "mamba_d_conv": 4,
        "mamba_chunk_size": 64, "expand": 2, "layer_norm_epsilon": 1e-5,
        "hybrid_override_pattern": "M-M*-", "num_hidden_layers": 5,
        **overrides,
    }  # fmt: skip


def test_nemotron_h_pattern_and_renamed_fields() -> None:
    cfg = normalise_mamba_config(_ARCH, _nemotron_h())
    assert cfg["num_hidden_layers"] == 5 and cfg["attention_bias"] is False
    fields = mamba_fields(_ARCH, cfg)
    assert fields["layer_types"] == (MAMBA, MLP, MAMBA, "full_attention", MLP)
    mamba = fields["mamba"]
    assert (mamba.n_groups, mamba.conv_kernel, mamba.chunk_size) == (2, 4, 64)
    # heads x head_dim, not expand x hidden (both 128 here; 4 x 32).
    assert mamba.intermediate_size == 128


def test_nemotron_h_block_list_wins_and_counts_the_layers() -> None:
    # transformers 5 writes the list and no num_hidden_layers; old names are accepted.
    raw = _nemotron_h(layers_block_type=["mamba", "attention", "mlp"], num_hidden_layers=None)
    fields = mamba_fields(_ARCH, normalise_mamba_config(_ARCH, raw))
    assert fields["layer_types"] == (MAMBA, "full_attention", MLP)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"hybrid_override_pattern": "M*E"}, "layers_block_type"),
        ({"mlp_hidden_act": "silu"}, "mlp_hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hybrid_override_pattern": ""}, "hybrid_override_pattern"),
    ],
)
def test_nemotron_h_unsupported_configs_are_refused(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        normalise_mamba_config(_ARCH, _nemotron_h(**overrides))


def test_falcon_h1_parallel_layers_and_multipliers() -> None:
    cfg = {
        "hidden_size": 64, "num_hidden_layers": 2, "mamba_d_ssm": 96, "mamba_n_heads": 4,
        "mamba_n_groups": 1, "mamba_d_state": 16, "projectors_bias": True,
        "ssm_multipliers": [1, 2, 3, 4, 5], "mlp_multipliers": [0.5, 2], "key_multiplier": 3,
    }  # fmt: skip
    fields = mamba_fields("FalconH1ForCausalLM", cfg)
    assert fields["layer_types"] == (PARALLEL_HYBRID,) * 2
    mamba = fields["mamba"]
    # mamba_d_ssm, not expand x hidden; HF's defaults: no norm, norm before the gate.
    assert (mamba.intermediate_size, mamba.head_dim) == (96, 24)
    assert (mamba.rms_norm, mamba.norm_before_gate, mamba.out_proj_bias) == (False, True, True)
    mup = fields["mup"]
    assert mup.ssm == (1, 2, 3, 4, 5) and mup.mlp == (0.5, 2) and mup.key == 3
    with pytest.raises(ValueError, match="ssm_multipliers"):
        mamba_fields("FalconH1ForCausalLM", {**cfg, "ssm_multipliers": [1, 2]})


def test_granite_hybrid_experts_shared_mlp_and_scalars() -> None:
    cfg = {
        "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 32,
        "shared_intermediate_size": 96, "num_local_experts": 4, "num_experts_per_tok": 2,
        "layer_types": ["mamba", "attention"], "mamba_n_heads": 4, "residual_multiplier": 0.5,
        "attention_multiplier": 0.25, "logits_scaling": 4.0,
    }  # fmt: skip
    arch = "GraniteMoeHybridForCausalLM"
    normalised = normalise_mamba_config(arch, cfg)
    assert normalised["intermediate_size"] == 96  # the shared MLP's
    fields = mamba_fields(arch, normalised)
    assert fields["layer_types"] == (MAMBA, "full_attention")
    assert (fields["moe"].num_experts, fields["moe"].intermediate_size) == (4, 32)
    mup = fields["mup"]
    assert (mup.attention_scale, mup.lm_head, mup.ssm_out, mup.mlp) == (0.25, 0.25, 0.5, (1, 0.5))
    assert fields["no_rope"]  # HF's default position_embedding_type (None) is NoPE
    dense = mamba_fields(arch, normalise_mamba_config(arch, {**cfg, "num_local_experts": 0}))
    assert "moe" not in dense
    with pytest.raises(ValueError, match="layer_types"):
        mamba_fields(arch, normalise_mamba_config(arch, {**cfg, "layer_types": ["mamba"]}))
