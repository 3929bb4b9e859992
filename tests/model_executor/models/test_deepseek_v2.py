"""DeepSeek loading details the end-to-end family tests do not reach."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvserve.model_executor.model_loader import get_model
from kvserve.model_executor.models.deepseek_v2 import mla_softmax_scale
from kvserve.transformers_utils.arch_config import load_arch_config
from kvserve.transformers_utils.model_resolver import resolve_model
from tests.family_models import build_family_model


def test_multi_token_prediction_layers_are_skipped(tmp_path: Path) -> None:
    """V3 checkpoints carry MTP layers past num_hidden_layers; they are not served."""
    build_family_model("deepseek_v3", tmp_path)
    [shard] = tmp_path.glob("*.safetensors")
    tensors = load_file(str(shard))
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    tensors["model.layers.2.self_attn.kv_b_proj.weight"] = torch.zeros(128, 16)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    resolved = resolve_model(str(tmp_path))
    model = get_model(resolved, load_arch_config(resolved))
    assert len(model.model.layers) == 2


def test_yarn_mscale_scales_the_softmax(tmp_path: Path) -> None:
    build_family_model("deepseek_v2", tmp_path)
    arch = load_arch_config(resolve_model(str(tmp_path)))
    assert arch.rope_scaling is not None and arch.rope_scaling["rope_type"] == "yarn"
    mscale = 0.1 * 1.0 * torch.log(torch.tensor(4.0)).item() + 1.0  # factor 4, mscale_all_dim 1
    assert abs(mla_softmax_scale(arch) - (16 + 8) ** -0.5 * mscale**2) < 1e-9
