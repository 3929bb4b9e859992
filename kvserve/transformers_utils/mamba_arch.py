"""The config.json fields of Mamba-2 mixers (pure ``Mamba2ForCausalLM`` and the
Mamba-2 / attention hybrids: Bamba, NemotronH, FalconH1, GraniteMoeHybrid), read into
one frozen record, with each family's layer pattern and scalars.

A Mamba layer keeps a fixed-size recurrent state per request instead of a growing KV:
the last ``conv_kernel - 1`` inputs of its causal conv1d and the SSM state of every
head. ``ArchConfig.layer_types`` says which layers are Mamba layers (``"mamba"``, or
``"parallel_hybrid"`` with attention beside), and which have no mixer (``"mlp"``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvserve.transformers_utils.arch_families import MoEConfig

MAMBA = "mamba"
# A layer with a feed-forward block and no token mixer (NemotronH's "-"): no cache.
MLP = "mlp"
# A layer whose Mamba-2 mixer and attention run side by side on the same input
# (FalconH1): a state block and attention pages.
PARALLEL_HYBRID = "parallel_hybrid"
# Bytes of one state element: the state is kept in float32 whatever the KV cache's dtype
# (the recurrence accumulates over the whole sequence).
STATE_DTYPE_SIZE = 4


@dataclass(frozen=True)
class MambaArch:
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    intermediate_size: int
    chunk_size: int
    use_conv_bias: bool
    use_bias: bool
    norm_eps: float
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    # The gated output norm: rmsnorm(y * silu(z)) by default; FalconH1 may norm before
    # the gate or have no norm (y * silu(z)).
    rms_norm: bool = True
    norm_before_gate: bool = False
    # out_proj's bias where it differs from in_proj's (FalconH1's projectors_bias).
    out_proj_bias: bool | None = None

    def __post_init__(self) -> None:
        if self.num_heads * self.head_dim != self.intermediate_size:
            raise ValueError(
                f"mamba heads x head_dim ({self.num_heads} x {self.head_dim}) must equal the "
                f"mixer's intermediate size {self.intermediate_size}"
            )
        if self.num_heads % self.n_groups:
            raise ValueError(f"mamba n_groups {self.n_groups} must divide {self.num_heads} heads")

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv1d: x, B and C."""
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_kernel - 1, self.conv_dim)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.state_size)

    @property
    def state_bytes(self) -> int:
        """One request's state in one layer."""
        numel = math.prod(self.conv_state_shape) + math.prod(self.ssm_state_shape)
        return numel * STATE_DTYPE_SIZE


@dataclass(frozen=True)
class MupMultipliers:
    """FalconH1's muP scalars: each scales one tensor of the forward (HF's names).
    ``ssm`` scales in_proj's outputs by part: z, x, B, C, dt."""

    embedding: float = 1.0
    lm_head: float = 1.0
    key: float = 1.0
    attention_in: float = 1.0
    attention_out: float = 1.0
    ssm_in: float = 1.0
    ssm_out: float = 1.0
    ssm: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)
    mlp: tuple[float, float] = (1.0, 1.0)  # gate, down
    # GraniteMoeHybrid's attention_multiplier: the score scale instead of 1/sqrt(d).
    attention_scale: float | None = None


def _float(value: Any) -> float:
    # transformers 5 writes infinities as {"__float__": "Infinity"} (JSON has none).
    return float(value["__float__"] if isinstance(value, dict) else value)


def _limit(cfg: dict[str, Any]) -> tuple[float, float]:
    limit = cfg.get("time_step_limit") or (0.0, math.inf)
    return (_float(limit[0]), _float(limit[1]))


# NemotronH's block kinds: transformers 5 names (and the pattern letters of
# ``hybrid_override_pattern``, and the older names) -> ArchConfig.layer_types.
_NEMOTRON_H_KINDS = {
    "linear_attention": MAMBA, "M": MAMBA, "mamba": MAMBA,
    "full_attention": "full_attention", "*": "full_attention", "attention": "full_attention",
    "mlp": MLP, "-": MLP,
}  # fmt: skip


def _nemotron_h_layer_types(cfg: dict[str, Any]) -> tuple[str, ...]:
    blocks = cfg.get("layers_block_type") or list(cfg.get("hybrid_override_pattern") or "")
    if not blocks:
        raise ValueError(
            "NemotronH config has neither layers_block_type nor hybrid_override_pattern"
        )
    unknown = sorted({str(b) for b in blocks} - set(_NEMOTRON_H_KINDS))
    if unknown:
        # "moe" / "E": routed experts (Nemotron 3 Nano) are not implemented here yet.
        raise ValueError(
            f"NemotronH layers_block_type {unknown} not supported (mamba, attention, mlp)"
        )
    return tuple(_NEMOTRON_H_KINDS[str(b)] for b in blocks)


def _nemotron_h_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 writes no num_hidden_layers (the block list's length is it), and
    NemotronH's attention has no bias whatever ``attention_bias`` says."""
    for key, wanted in (
        ("mlp_hidden_act", "relu2"),
        ("mamba_hidden_act", "silu"),
        ("mlp_bias", False),
    ):
        if cfg.get(key, wanted) != wanted:
            raise ValueError(f"NemotronH {key} {cfg[key]!r} not supported (only {wanted!r})")
    return {
        **cfg,
        "num_hidden_layers": len(_nemotron_h_layer_types(cfg)),
        "rms_norm_eps": cfg.get("layer_norm_epsilon", 1e-5),
        "attention_bias": False,
    }


def normalise_mamba_config(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The top-level numbers ArchConfig reads, where a family's config.json spells them
    otherwise: a pure Mamba-2 lacks the attention ones (filled with what they mean
    there: no attention layers, no MLP), NemotronH counts its layers by its pattern,
    GraniteMoeHybrid's dense MLP is its shared one."""
    if arch == "NemotronHForCausalLM":
        return _nemotron_h_config(cfg)
    if arch == "GraniteMoeHybridForCausalLM":
        # ArchConfig's MLP is the shared one every token takes; the experts' size moves.
        return {
            **cfg,
            "intermediate_size": cfg.get("shared_intermediate_size", 1024),
            "expert_intermediate_size": cfg.get("intermediate_size"),
        }
    if arch != "Mamba2ForCausalLM":
        return cfg
    hidden = int(cfg["hidden_size"])
    return {
        **cfg,
        "num_attention_heads": cfg.get("num_attention_heads") or 1,
        "intermediate_size": cfg.get("intermediate_size") or int(cfg.get("expand", 2)) * hidden,
        "rms_norm_eps": cfg.get("layer_norm_epsilon", 1e-5),
        "max_position_embeddings": cfg.get("max_position_embeddings") or 1 << 20,
    }


def mamba_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """``ArchConfig`` keyword arguments of a Mamba-2 family (empty for the others)."""
    if arch == "Mamba2ForCausalLM":
        hidden = int(cfg["hidden_size"])
        mamba = MambaArch(
            num_heads=int(cfg["num_heads"]),
            head_dim=int(cfg["head_dim"]),
            state_size=int(cfg["state_size"]),
            n_groups=int(cfg.get("n_groups", 1)),
            conv_kernel=int(cfg.get("conv_kernel", 4)),
            intermediate_size=int(cfg.get("expand", 2)) * hidden,
            chunk_size=int(cfg.get("chunk_size", 256)),
            use_conv_bias=bool(cfg.get("use_conv_bias", True)),
            use_bias=bool(cfg.get("use_bias", False)),
            norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
            time_step_limit=_limit(cfg),
        )
        return {"mamba": mamba, "layer_types": (MAMBA,) * int(cfg["num_hidden_layers"])}
    if arch == "BambaForCausalLM":
        hidden = int(cfg["hidden_size"])
        n_heads = int(cfg.get("mamba_n_heads", 128))
        expand = int(cfg.get("mamba_expand", 2))
        d_head = cfg.get("mamba_d_head", "auto")
        mamba = MambaArch(
            num_heads=n_heads,
            head_dim=expand * hidden // n_heads if d_head == "auto" else int(d_head),
            state_size=int(cfg.get("mamba_d_state", 256)),
            n_groups=int(cfg.get("mamba_n_groups", 1)),
            conv_kernel=int(cfg.get("mamba_d_conv", 4)),
            intermediate_size=expand * hidden,
            chunk_size=int(cfg.get("mamba_chunk_size", 256)),
            use_conv_bias=bool(cfg.get("mamba_conv_bias", True)),
            use_bias=bool(cfg.get("mamba_proj_bias", False)),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            time_step_limit=_limit(cfg),
        )
        attn = set(cfg.get("attn_layer_indices") or ())
        layer_types = tuple(
            "full_attention" if i in attn else MAMBA for i in range(int(cfg["num_hidden_layers"]))
        )
        return {"mamba": mamba, "layer_types": layer_types}
    if arch == "NemotronHForCausalLM":
        return {"mamba": _nemotron_h_mamba(cfg), "layer_types": _nemotron_h_layer_types(cfg)}
    if arch == "FalconH1ForCausalLM":
        return _falcon_h1_fields(cfg)
    if arch == "GraniteMoeHybridForCausalLM":
        return _granite_hybrid_fields(cfg)
    return {}


_GRANITE_KINDS = {
    "mamba": MAMBA, "linear_attention": MAMBA,
    "attention": "full_attention", "full_attention": "full_attention",
}  # fmt: skip


def _granite_hybrid_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Bamba's Mamba fields; Granite's multipliers as muP scalars (the residual one
    scales every mixer's and MLP's output)."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"GraniteMoeHybrid hidden_act {cfg['hidden_act']!r} not supported")
    fields = mamba_fields("BambaForCausalLM", {**cfg, "attn_layer_indices": []})
    blocks = cfg.get("layer_types") or cfg.get("layers_block_type") or []
    if len(blocks) != int(cfg["num_hidden_layers"]):
        raise ValueError("GraniteMoeHybrid layer_types must name every layer")
    unknown = sorted({str(b) for b in blocks} - set(_GRANITE_KINDS))
    if unknown:
        raise ValueError(f"GraniteMoeHybrid layer_types {unknown} not supported")
    residual = float(cfg.get("residual_multiplier", 1.0))
    mup = MupMultipliers(
        embedding=float(cfg.get("embedding_multiplier", 1.0)),
        lm_head=1.0 / float(cfg.get("logits_scaling", 1.0)),
        attention_out=residual,
        ssm_out=residual,
        mlp=(1.0, residual),
        attention_scale=float(cfg.get("attention_multiplier", 1.0)),
    )
    fields.update(layer_types=tuple(_GRANITE_KINDS[str(b)] for b in blocks), mup=mup)
    # Granite 4.0-H has no positions in its attention ("nope"; HF's default None).
    fields["no_rope"] = cfg.get("position_embedding_type") != "rope"
    num_experts = int(cfg.get("num_local_experts") or 0)
    if num_experts:  # softmax over the top-k logits = softmax, renormalised over top-k
        fields["moe"] = MoEConfig(
            num_experts=num_experts,
            top_k=int(cfg.get("num_experts_per_tok", 2)),
            intermediate_size=int(cfg["expert_intermediate_size"]),
        )
    return fields


def _falcon_h1_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    for key, wanted in (("hidden_act", "silu"), ("mlp_bias", False)):
        if cfg.get(key, wanted) != wanted:
            raise ValueError(f"FalconH1 {key} {cfg[key]!r} not supported (only {wanted!r})")
    hidden = int(cfg["hidden_size"])
    d_ssm = cfg.get("mamba_d_ssm") or int(cfg.get("mamba_expand", 2)) * hidden
    n_heads = int(cfg.get("mamba_n_heads", 128))
    d_head = cfg.get("mamba_d_head", "auto")
    mamba = MambaArch(
        num_heads=n_heads,
        head_dim=int(d_ssm) // n_heads if d_head == "auto" else int(d_head),
        state_size=int(cfg.get("mamba_d_state", 256)),
        n_groups=int(cfg.get("mamba_n_groups", 1)),
        conv_kernel=int(cfg.get("mamba_d_conv", 4)),
        intermediate_size=int(d_ssm),
        chunk_size=int(cfg.get("mamba_chunk_size", 256)),
        use_conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        use_bias=bool(cfg.get("mamba_proj_bias", False)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        time_step_limit=_limit(cfg),
        rms_norm=bool(cfg.get("mamba_rms_norm", False)),
        norm_before_gate=bool(cfg.get("mamba_norm_before_gate", True)),
        out_proj_bias=bool(cfg.get("projectors_bias", False)),
    )
    ssm = tuple(float(m) for m in cfg.get("ssm_multipliers") or (1.0,) * 5)
    mlp = tuple(float(m) for m in cfg.get("mlp_multipliers") or (1.0,) * 2)
    if len(ssm) != 5 or len(mlp) != 2:
        raise ValueError("FalconH1 ssm_multipliers needs 5 values and mlp_multipliers 2")
    mup = MupMultipliers(
        embedding=float(cfg.get("embedding_multiplier", 1.0)),
        lm_head=float(cfg.get("lm_head_multiplier", 1.0)),
        key=float(cfg.get("key_multiplier", 1.0)),
        attention_in=float(cfg.get("attention_in_multiplier", 1.0)),
        attention_out=float(cfg.get("attention_out_multiplier", 1.0)),
        ssm_in=float(cfg.get("ssm_in_multiplier", 1.0)),
        ssm_out=float(cfg.get("ssm_out_multiplier", 1.0)),
        ssm=(ssm[0], ssm[1], ssm[2], ssm[3], ssm[4]),
        mlp=(mlp[0], mlp[1]),
    )
    layers = (PARALLEL_HYBRID,) * int(cfg["num_hidden_layers"])
    return {"mamba": mamba, "layer_types": layers, "mup": mup}


def _first(cfg: dict[str, Any], keys: tuple[str, ...], default: Any) -> Any:
    """The first of ``keys`` present (transformers 5 renamed NemotronH's ``mamba_*``)."""
    return next((cfg[k] for k in keys if cfg.get(k) is not None), default)


def _nemotron_h_mamba(cfg: dict[str, Any]) -> MambaArch:
    n_heads, d_head = int(cfg.get("mamba_num_heads", 128)), int(cfg.get("mamba_head_dim", 64))
    limit = _first(cfg, ("time_step_limit", "mamba_dt_limit"), None)
    return MambaArch(
        num_heads=n_heads,
        head_dim=d_head,
        state_size=int(cfg.get("ssm_state_size", 128)),
        n_groups=int(_first(cfg, ("n_groups", "mamba_n_groups"), 8)),
        conv_kernel=int(_first(cfg, ("conv_kernel", "mamba_d_conv"), 4)),
        # Heads x head_dim, not expand x hidden (the checkpoints' expand may disagree).
        intermediate_size=n_heads * d_head,
        chunk_size=int(_first(cfg, ("chunk_size", "mamba_chunk_size"), 128)),
        use_conv_bias=bool(_first(cfg, ("use_conv_bias", "mamba_conv_bias"), True)),
        # HF's mixer takes its projections' bias from use_bias (mamba_proj_bias is unused).
        use_bias=bool(cfg.get("use_bias", False)),
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        time_step_limit=_limit({"time_step_limit": limit}),
    )


__all__ = [
    "MAMBA",
    "MLP",
    "STATE_DTYPE_SIZE",
    "MambaArch",
    "mamba_fields",
    "normalise_mamba_config",
]
