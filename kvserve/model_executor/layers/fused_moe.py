"""Mixture of experts with grouped execution (vLLM's ``FusedMoE``).

A router picks ``top_k`` experts per token (``select_experts``); ``fused_experts`` then
sorts the ``T * top_k`` (token, expert) pairs by expert so each expert's rows sit
together, and multiplies all of them in one grouped GEMM per projection
(``torch.nn.functional.grouped_mm``: one call for every expert's gate/up, one for the
down projections), instead of a Python loop over experts or tokens. Each token's
outputs are weighted and summed back with one ``index_add_``.

The expert weights are stacked: ``w13_weight [E, 2 * I, H]`` (gate rows then up rows)
and ``w2_weight [E, H, I]``. Tensor parallelism splits the intermediate dim ``I`` of
every expert across ranks (vLLM's TP layout for experts): each rank holds
``I / tp_size`` rows of w1/w3 and columns of w2, and the partial outputs are all-reduced
where ``RowParallelLinear`` reduces. With expert parallelism each rank instead holds
whole experts, a share of them (expert_parallel.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model_executor.layers.expert_parallel import make_experts_placement
from kvserve.model_executor.layers.linear import divide
from kvserve.transformers_utils.arch_families import MoEConfig


def select_experts(
    router_logits: torch.Tensor,
    config: MoEConfig,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits [T, E]`` -> (weights float32 ``[T, k]``, expert ids int64 ``[T, k]``)
    by the family's rule (see ``MoEConfig``)."""
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if config.scoring_func == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if config.num_expert_group and config.topk_group:
        num_tokens, groups = scores.shape[0], config.num_expert_group
        grouped = choice.view(num_tokens, groups, -1)
        if correction_bias is not None:  # V3: a group counts by its two best experts
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        group_idx = torch.topk(group_scores, k=config.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, -1)
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
    topk_ids = torch.topk(choice, k=config.top_k, dim=-1)[1]
    topk_weights = scores.gather(1, topk_ids)
    if config.renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    if config.routed_scaling_factor != 1.0:
        topk_weights = topk_weights * config.routed_scaling_factor
    return topk_weights, topk_ids


def fused_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int = 0,
    global_num_experts: int | None = None,
) -> torch.Tensor:
    """``sum_k w[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` for ``e = topk_ids[t, k]``;
    ``hidden_states [T, H]``, ``w13 [E, 2I, H]``, ``w2 [E, H, I]``. Where the weights
    hold only experts ``[first_expert, first_expert + E)`` of ``global_num_experts``
    (expert parallelism), the other experts' terms are left out (other ranks add them)."""
    top_k = topk_ids.shape[1]
    num_experts = w13.shape[0]
    flat_ids = topk_ids.reshape(-1)
    out = torch.zeros_like(hidden_states)
    if flat_ids.numel() == 0:
        return out
    local_only = global_num_experts is not None and global_num_experts != num_experts
    if local_only:
        flat_ids = flat_ids - first_expert
        # Others' experts go to a bucket past the last, which the sort puts at the end.
        flat_ids = flat_ids.masked_fill((flat_ids < 0) | (flat_ids >= num_experts), num_experts)
    # Stable: within an expert, rows keep token order (deterministic sums).
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts)
    if local_only:
        counts = counts[:num_experts]
        num_rows = int(counts.sum())
        if num_rows == 0:
            return out
        order = order[:num_rows]
    token_of_row = order // top_k
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    rows = hidden_states.index_select(0, token_of_row)
    gate_up = F.grouped_mm(rows, w13.transpose(1, 2), offs=offsets)
    intermediate = w13.shape[1] // 2
    activated = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
    down = F.grouped_mm(activated, w2.transpose(1, 2), offs=offsets)
    down = down * topk_weights.reshape(-1)[order].to(down.dtype).unsqueeze(-1)
    return out.index_add_(0, token_of_row, down)


class FusedMoE(nn.Module):
    """The routed experts of one MoE layer: ``forward(hidden_states, router_logits)``.

    ``weight_loader(param, tensor, shard_id, expert_id)`` takes one expert's ``w1`` /
    ``w3`` (``[I, H]``) or ``w2`` (``[H, I]``) as checkpoints store them, or with
    ``expert_id=None`` all experts stacked (``[E, I, H]`` / ``[E, H, I]``, GGUF's layout).
    """

    def __init__(self, config: MoEConfig, hidden_size: int, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        self.prefix = prefix
        self.hidden_size = hidden_size
        self.experts = make_experts_placement(config.num_experts)
        self.placement = self.experts.placement
        self.tp_rank, self.tp_size = self.experts.tp_rank, self.experts.tp_size
        self.intermediate_size_per_partition = divide(config.intermediate_size, self.tp_size)
        size = self.intermediate_size_per_partition
        num_experts = self.placement.num_local_experts
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * size, hidden_size), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, size), requires_grad=False
        )
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(
        self,
        param: nn.Parameter,
        loaded: torch.Tensor,
        shard_id: str,
        expert_id: int | None = None,
    ) -> None:
        size = self.intermediate_size_per_partition
        if shard_id == "w2":  # [.., H, I]: this rank's columns
            shard = loaded.narrow(-1, self.tp_rank * size, size)
            target = param.data
        else:  # [.., I, H]: this rank's rows, into the gate or the up half
            shard = loaded.narrow(-2, self.tp_rank * size, size)
            offset = 0 if shard_id == "w1" else size
            target = param.data.narrow(-2, offset, size)
        if expert_id is not None:
            local = self.placement.local_index(expert_id)
            if local is None:
                return  # another expert-parallel rank holds it
            target = target[local]
        elif self.placement.ep_size > 1:  # all experts stacked: this rank's run of them
            shard = shard.narrow(0, self.placement.first_local_expert, target.shape[0])
        if target.shape != shard.shape:
            raise ValueError(
                f"{self.prefix}: expert weight {shard_id} shape {tuple(shard.shape)} does not "
                f"fit {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(shard)

    def forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        correction_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        dispatched = self.experts.dispatch(hidden_states, router_logits)
        weights, ids = select_experts(dispatched.router_logits, self.config, correction_bias)
        out = fused_experts(
            dispatched.hidden_states,
            self.w13_weight,
            self.w2_weight,
            weights,
            ids,
            self.placement.first_local_expert,
            self.config.num_experts,
        )
        return self.experts.combine(out, dispatched)

    def dummy_forward(self) -> None:
        """This layer's collectives with no tokens of this rank's own: what a core
        without requests runs while another core steps (expert parallelism)."""
        hidden = self.w2_weight.new_empty((0, self.hidden_size))
        self.forward(hidden, hidden.new_empty((0, self.config.num_experts), dtype=torch.float32))

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"experts={c.num_experts}, top_k={c.top_k}, intermediate={c.intermediate_size}, "
            f"scoring={c.scoring_func}, tp={self.tp_rank}/{self.tp_size}, "
            f"ep={self.placement.ep_rank}/{self.placement.ep_size}"
        )


__all__ = ["FusedMoE", "fused_experts", "select_experts"]
