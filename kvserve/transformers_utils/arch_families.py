"""The config.json fields of model families beyond the Llama shape: mixture of experts
(Mixtral, Qwen3-MoE, DeepSeek), Multi-head Latent Attention (DeepSeek) and per-head q/k
norms (Qwen3). ``ArchConfig`` carries them as two small frozen records so the dense
models never see them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

ScoringFunc = Literal["softmax", "sigmoid"]


@dataclass(frozen=True)
class MoEConfig:
    """How a family routes tokens to experts.

    Scores are ``softmax`` or ``sigmoid`` of the router logits; with ``num_expert_group``
    set, only the ``topk_group`` best groups of experts are eligible (DeepSeek's
    group-limited routing, a group scored by its best expert or, with a correction bias,
    by the sum of its two best). ``renormalize`` rescales the chosen weights to sum to one;
    ``routed_scaling_factor`` multiplies them afterwards. Shared experts run on every
    token. Layer ``i`` is sparse iff ``i >= first_k_dense_replace``, ``(i + 1) %
    sparse_step == 0`` and ``i not in dense_layers``.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    scoring_func: ScoringFunc = "softmax"
    renormalize: bool = True
    routed_scaling_factor: float = 1.0
    num_expert_group: int | None = None
    topk_group: int | None = None
    # DeepSeek-V3's e_score_correction_bias: added to scores to choose, not to weigh.
    has_correction_bias: bool = False
    num_shared_experts: int = 0
    first_k_dense_replace: int = 0
    sparse_step: int = 1
    dense_layers: tuple[int, ...] = ()

    def is_sparse_layer(self, layer: int) -> bool:
        return (
            layer >= self.first_k_dense_replace
            and (layer + 1) % self.sparse_step == 0
            and layer not in self.dense_layers
        )


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's Multi-head Latent Attention. Each token caches one latent of
    ``kv_lora_rank`` (compressed K and V) plus ``qk_rope_head_dim`` (the shared rotated
    key); ``rope_interleave``: the checkpoint rotates interleaved pairs."""

    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    @property
    def latent_size(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


def _moe_mixtral(cfg: dict[str, Any]) -> MoEConfig:
    return MoEConfig(
        num_experts=int(cfg["num_local_experts"]),
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["intermediate_size"]),
    )


def _moe_qwen3(cfg: dict[str, Any]) -> MoEConfig:
    return MoEConfig(
        num_experts=int(cfg.get("num_experts") or cfg["num_local_experts"]),
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["moe_intermediate_size"]),
        renormalize=bool(cfg.get("norm_topk_prob", False)),
        sparse_step=int(cfg.get("decoder_sparse_step") or 1),
        dense_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
    )


def _moe_deepseek(cfg: dict[str, Any], v3: bool) -> MoEConfig:
    topk_method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ValueError(f"unsupported DeepSeek topk_method {topk_method!r}")
    grouped = topk_method != "greedy"
    scoring: ScoringFunc = "sigmoid" if v3 else "softmax"
    if cfg.get("scoring_func") is not None:
        if cfg["scoring_func"] not in ("softmax", "sigmoid"):
            raise ValueError(f"unsupported DeepSeek scoring_func {cfg['scoring_func']!r}")
        scoring = cfg["scoring_func"]
    return MoEConfig(
        num_experts=int(cfg.get("n_routed_experts") or cfg["num_local_experts"]),
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["moe_intermediate_size"]),
        scoring_func=scoring,
        renormalize=bool(cfg.get("norm_topk_prob", v3)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        num_expert_group=int(cfg["n_group"]) if grouped and cfg.get("n_group") else None,
        topk_group=int(cfg["topk_group"]) if grouped and cfg.get("topk_group") else None,
        has_correction_bias=topk_method == "noaux_tc",
        num_shared_experts=int(cfg.get("n_shared_experts") or 0),
        first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
        sparse_step=int(cfg.get("moe_layer_freq") or 1),
    )


def _mla(cfg: dict[str, Any], v3: bool) -> MLAConfig:
    q_lora = cfg.get("q_lora_rank")
    return MLAConfig(
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        q_lora_rank=None if q_lora is None else int(q_lora),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        # V2 rotates complex (interleaved) pairs; V3 says so in rope_interleave.
        rope_interleave=bool(cfg.get("rope_interleave", True)) if v3 else True,
    )


# In-tree models whose MLPs are SiLU-gated (out-of-tree ones check their own).
_SILU_ARCHITECTURES = frozenset({
    "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Llama4ForCausalLM",
    "MixtralForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Phi3ForCausalLM",
})  # fmt: skip


def family_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """``ArchConfig`` keyword arguments for ``arch``'s family (empty for dense Llama-like
    models)."""
    act = cfg.get("hidden_act", "silu")
    if arch in _SILU_ARCHITECTURES and act not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {act!r} for {arch} (supported: silu)")
    if arch == "MixtralForCausalLM":
        return {"moe": _moe_mixtral(cfg)}
    if arch == "Qwen3ForCausalLM":
        return {"qk_norm": True}
    if arch == "Qwen3MoeForCausalLM":
        return {"qk_norm": True, "moe": _moe_qwen3(cfg)}
    if arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        v3 = arch == "DeepseekV3ForCausalLM"
        return {"moe": _moe_deepseek(cfg, v3), "mla": _mla(cfg, v3)}
    if arch == "Phi3ForCausalLM":
        partial = float((cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
        if cfg.get("partial_rotary_factor", partial) != 1.0:
            raise ValueError("Phi-3 with partial_rotary_factor != 1 is not supported")
    return {}


__all__ = ["MLAConfig", "MoEConfig", "ScoringFunc", "family_fields"]
