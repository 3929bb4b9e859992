"""Where a MoE layer's experts live and how tokens reach them (vLLM's expert parallelism).

Without expert parallelism every rank holds every expert (tensor parallelism splits
each expert's intermediate dim, and the partial outputs are all-reduced over the TP
group): ``TensorParallelExperts``.

With it (``--enable-expert-parallel``) the EP group, every data-parallel core's TP
ranks, shares the experts out: rank ``r`` of ``n`` holds experts
``[r * E / n, (r + 1) * E / n)`` whole, and loads nothing else. Attention stays data
parallel, so each core has tokens of its own requests; ``ExpertParallelExperts``
dispatches every core's tokens to every rank (an all-gather over the DP group, padded to
the longest core's count), each rank applies its experts to them (a token's other
experts contribute zero there), and the partial outputs are combined by a sum over the
EP group, of which each core keeps its own rows. That is the all-gather + all-reduce form
of the dispatch, chosen for being exact and simple over gloo; an all-to-all that moves
only each token's chosen experts' rows is the faster form for large EP groups.

Every core must enter every MoE layer's collectives in every step, so a core without
requests runs ``dummy_forward`` (zero tokens) while any other core steps
(engine_core/dp_wave.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.distributed.parallel_state import (
    get_dp_group,
    get_ep_group,
    get_tp_group,
)
from kvserve.model_executor.layers.linear import get_tp_rank_size


@dataclass(frozen=True)
class ExpertPlacement:
    """The contiguous run of experts one rank holds."""

    num_experts: int
    ep_rank: int = 0
    ep_size: int = 1

    def __post_init__(self) -> None:
        if self.num_experts % self.ep_size:
            raise ValueError(
                f"expert parallelism: {self.num_experts} experts do not split evenly over "
                f"{self.ep_size} ranks (data_parallel_size x tensor_parallel_size)"
            )

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def first_local_expert(self) -> int:
        return self.ep_rank * self.num_local_experts

    def local_index(self, expert_id: int) -> int | None:
        """The expert's index among this rank's, or None if another rank holds it."""
        index = expert_id - self.first_local_expert
        return index if 0 <= index < self.num_local_experts else None


@dataclass
class Dispatched:
    """The tokens a rank's experts run on, and which of their rows are this core's."""

    hidden_states: torch.Tensor
    router_logits: torch.Tensor
    start: int
    num_tokens: int


class TensorParallelExperts:
    """Every expert on every rank, split on the intermediate dim across the TP group."""

    def __init__(self, num_experts: int) -> None:
        self.placement = ExpertPlacement(num_experts)
        self.tp_group = get_tp_group()
        self.tp_rank, self.tp_size = get_tp_rank_size()

    def dispatch(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> Dispatched:
        return Dispatched(hidden_states, router_logits, 0, hidden_states.shape[0])

    def combine(self, out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        # Each rank holds a slice of every expert's intermediate dim: sum the slices.
        return self.tp_group.all_reduce(out)


class ExpertParallelExperts:
    """Experts sharded over the EP group; tokens gathered over the DP group."""

    def __init__(self, num_experts: int) -> None:
        self.ep_group = get_ep_group()
        self.dp_group = get_dp_group()
        self.placement = ExpertPlacement(
            num_experts, self.ep_group.rank_in_group, self.ep_group.world_size
        )
        # Each expert is whole on its rank: nothing of it is split over the TP group.
        self.tp_rank, self.tp_size = 0, 1

    def dispatch(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> Dispatched:
        dp = self.dp_group
        num_tokens = hidden_states.shape[0]
        if dp.world_size == 1:
            return Dispatched(hidden_states, router_logits, 0, num_tokens)
        counts = dp.all_gather(torch.tensor([num_tokens], dtype=torch.int64), dim=0)
        padded = int(counts.max())
        if padded == 0:  # no core has a token: the collectives below would move nothing
            return Dispatched(hidden_states, router_logits, 0, 0)
        keep = torch.cat([torch.arange(int(n)) + i * padded for i, n in enumerate(counts)])
        hidden = dp.all_gather(_pad_rows(hidden_states, padded), dim=0).index_select(0, keep)
        logits = dp.all_gather(_pad_rows(router_logits, padded), dim=0).index_select(0, keep)
        start = int(counts[: dp.rank_in_group].sum())
        return Dispatched(hidden, logits, start, num_tokens)

    def combine(self, out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        if out.shape[0] == 0:
            return out
        out = self.ep_group.all_reduce(out)
        return out.narrow(0, dispatched.start, dispatched.num_tokens)


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor
    padded = tensor.new_zeros((rows, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    return padded


ExpertsPlacement = TensorParallelExperts | ExpertParallelExperts


def make_experts_placement(num_experts: int) -> ExpertsPlacement:
    """Expert parallelism where the distributed environment set an EP group up."""
    if get_ep_group().world_size > 1:
        return ExpertParallelExperts(num_experts)
    return TensorParallelExperts(num_experts)


__all__ = [
    "Dispatched",
    "ExpertParallelExperts",
    "ExpertPlacement",
    "TensorParallelExperts",
    "make_experts_placement",
]
