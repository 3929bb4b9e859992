"""Filling a model's parameters from HF-named checkpoint tensors (shared by all models)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch
from torch import nn

# One expert's projection (`mlp.experts.3.gate_proj.weight`) or all experts stacked
# (`mlp.experts.gate_proj.weight`, the GGUF loader's name) -> FusedMoE's parameters.
_EXPERT_RE = re.compile(
    r"^(.*\.experts)\.(?:(\d+)\.)?(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)
_EXPERT_SHARDS = {"gate_proj": "w1", "w1": "w1", "up_proj": "w3", "w3": "w3",
                  "down_proj": "w2", "w2": "w2"}  # fmt: skip


def expert_target(name: str) -> tuple[str, str, int | None] | None:
    """``(parameter name, shard id, expert id or None for all)`` of an expert weight."""
    match = _EXPERT_RE.match(name)
    if match is None:
        return None
    module, expert, proj = match.groups()
    shard = _EXPERT_SHARDS[proj]
    param = f"{module}.{'w2_weight' if shard == 'w2' else 'w13_weight'}"
    return param, shard, None if expert is None else int(expert)


def load_hf_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params: Mapping[str, tuple[str, str | int]],
    tie_word_embeddings: bool,
) -> set[str]:
    """Load HF-named tensors into ``model``; ``stacked_params`` maps a checkpoint
    sub-name (``.q_proj.``) to its fused parameter sub-name and shard id. Returns the
    parameter names filled and raises if any parameter was left unset."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue
        if name == "lm_head.weight" and tie_word_embeddings:
            continue  # some checkpoints store the tied copy too
        expert = expert_target(name)
        if expert is not None:
            param_name, shard, expert_id = expert
            param = _param(params, param_name, name)
            param.weight_loader(param, tensor, shard, expert_id)  # type: ignore[attr-defined]
            loaded.add(param_name)
            continue
        for ckpt_part, (param_part, shard_id) in stacked_params.items():
            if ckpt_part in name:
                fused = name.replace(ckpt_part, param_part)
                param = _param(params, fused, name)
                param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]
                loaded.add(fused)
                break
        else:
            param = _param(params, name, name)
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor)
            loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint did not provide parameters: {missing[:8]}")
    return loaded


def _param(params: dict[str, nn.Parameter], name: str, ckpt_name: str) -> nn.Parameter:
    if name not in params:
        raise ValueError(f"checkpoint tensor {ckpt_name!r} matches no model parameter")
    return params[name]


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs {tuple(loaded.shape)}")
    with torch.no_grad():
        param.copy_(loaded)
