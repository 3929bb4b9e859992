"""Tensor-parallel linear layers.

Each layer stores only its shard of the weight and knows where that shard lies in the
full checkpoint tensor (``shard_range``): ``weight_loader`` cuts float32 weights with it,
and the GGUF block path (quantization.attach_gguf_blocks) cuts the file's blocks with
it. With ``tp_size == 1`` the shard is the whole tensor and no collective runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import _custom_ops as ops
from kvserve.distributed.parallel_state import get_tp_group

if TYPE_CHECKING:
    from kvserve.model_executor.layers.block_weight import LinearBlocks

# (dim, start, size): where this rank's shard lies in the full checkpoint tensor.
ShardRange = tuple[int, int, int]
# From this many rows on ops.dense_linear takes oneDNN (kOneDnnRows in
# block_gemm.cpp); below, it is F.linear, called here without a trip through the op.
DENSE_GEMM_ROWS = 256


def get_tp_rank_size() -> tuple[int, int]:
    """(tp_rank, tp_size) of this process: (0, 1) unless parallel_state set up TP."""
    group = get_tp_group()
    return group.rank_in_group, group.world_size


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by tp_size {denominator}")
    return numerator // denominator


def _attach_loader(param: nn.Parameter, loader: object) -> nn.Parameter:
    # Model load_weights() looks the loader up on the parameter, as vLLM does, so
    # tied or shared parameters keep working without knowing their owning module.
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


class LinearBase(nn.Module):
    weight: nn.Parameter

    def __init__(self, input_size: int, output_size: int, prefix: str = "") -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.prefix = prefix
        self.tp_rank, self.tp_size = get_tp_rank_size()
        # Set by quantize_model (--quantization): the weight as GGUF blocks.
        self.quant_weight: LinearBlocks | None = None

    def shard_range(self, param_dim: int, shard_id: str | int | None = None) -> ShardRange | None:
        """Where this rank's part of the checkpoint tensor (``param_dim``: 2 for the
        weight, 1 for the bias; ``shard_id`` for a fused layer's part) lies; None: all."""
        return None

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_weight is not None:
            return self.quant_weight.linear(x)
        # Long inputs (prefill chunks) take the GEMM the lossless block path takes once it
        # has dequantized its weight, so both give the same bits there.
        if x.numel() >= DENSE_GEMM_ROWS * x.shape[-1] and ops.use_for(x):
            return ops.dense_linear(x, self.weight)
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, tp={self.tp_rank}/{self.tp_size}"


class ColumnParallelLinear(LinearBase):
    """``Y = X A^T + b`` with A split along its output rows across TP ranks."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, prefix: str = ""
    ) -> None:
        super().__init__(input_size, output_size, prefix)
        self.output_size_per_partition = divide(output_size, self.tp_size)
        self.weight = _attach_loader(
            nn.Parameter(
                torch.empty(self.output_size_per_partition, input_size), requires_grad=False
            ),
            self.weight_loader,
        )
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = _attach_loader(
                nn.Parameter(torch.empty(self.output_size_per_partition), requires_grad=False),
                self.weight_loader,
            )

    def shard_range(self, param_dim: int, shard_id: str | int | None = None) -> ShardRange | None:
        size = self.output_size_per_partition
        return 0, self.tp_rank * size, size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        _copy(param, _narrow(loaded, self.shard_range(param.dim())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # With TP the output stays sharded; the following RowParallelLinear reduces.
        out = self._matmul(x)
        return out if self.bias is None else out + self.bias


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections fused along the output dim (gate + up)."""

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool = False, prefix: str = ""
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, prefix)

    def shard_range(self, param_dim: int, shard_id: str | int | None = None) -> ShardRange | None:
        assert isinstance(shard_id, int)
        size = divide(self.output_sizes[shard_id], self.tp_size)
        return 0, self.tp_rank * size, size

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int
    ) -> None:
        offset = divide(sum(self.output_sizes[:shard_id]), self.tp_size)
        size = divide(self.output_sizes[shard_id], self.tp_size)
        _copy(param.data.narrow(0, offset, size), _narrow(loaded, self.shard_range(1, shard_id)))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection. Heads are split across ranks; when there are fewer KV
    heads than ranks, each KV head is replicated on ``tp_size // num_kv_heads`` ranks."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        prefix: str = "",
    ) -> None:
        _, tp_size = get_tp_rank_size()
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.kv_replicas = divide(tp_size, total_num_kv_heads)
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size)
            self.kv_replicas = 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * tp_size * head_size
        super().__init__(hidden_size, output_size, bias, prefix)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_size

    def shard_range(self, param_dim: int, shard_id: str | int | None = None) -> ShardRange | None:
        if shard_id == "q":
            return 0, self.tp_rank * self.q_size, self.q_size
        if shard_id in ("k", "v"):
            # Replicated KV heads: ranks r*replicas .. (r+1)*replicas-1 share head r.
            return 0, (self.tp_rank // self.kv_replicas) * self.kv_size, self.kv_size
        raise ValueError(f"unknown qkv shard id {shard_id!r}")

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str
    ) -> None:
        offset = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}.get(shard_id, 0)
        where = self.shard_range(param.dim(), shard_id)
        assert where is not None
        _copy(param.data.narrow(0, offset, where[2]), _narrow(loaded, where))


class RowParallelLinear(LinearBase):
    """``Y = X A^T + b`` with A split along its input columns; partial sums are
    all-reduced across ranks and the bias is added once, after the reduction."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, prefix: str = ""
    ) -> None:
        super().__init__(input_size, output_size, prefix)
        self.input_size_per_partition = divide(input_size, self.tp_size)
        self.weight = _attach_loader(
            nn.Parameter(
                torch.empty(output_size, self.input_size_per_partition), requires_grad=False
            ),
            self.weight_loader,
        )
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = _attach_loader(
                nn.Parameter(torch.empty(output_size), requires_grad=False), self.weight_loader
            )

    def shard_range(self, param_dim: int, shard_id: str | int | None = None) -> ShardRange | None:
        if param_dim == 1:  # the bias is replicated, not sharded
            return None
        size = self.input_size_per_partition
        return 1, self.tp_rank * size, size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        _copy(param, _narrow(loaded, self.shard_range(param.dim())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x)
        if self.tp_size > 1:  # each rank holds a partial sum over its input columns
            out = get_tp_group().all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out


class ReplicatedLinear(LinearBase):
    """``Y = X A^T + b`` with the whole weight on every rank (small projections such as
    MLA's latent down-projections, which every head needs)."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, prefix: str = ""
    ) -> None:
        super().__init__(input_size, output_size, prefix)
        self.weight = _attach_loader(
            nn.Parameter(torch.empty(output_size, input_size), requires_grad=False), _copy_param
        )
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = _attach_loader(
                nn.Parameter(torch.empty(output_size), requires_grad=False), _copy_param
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x)
        return out if self.bias is None else out + self.bias


def _narrow(loaded: torch.Tensor, where: ShardRange | None) -> torch.Tensor:
    return loaded if where is None else loaded.narrow(*where)


def _copy_param(param: nn.Parameter, loaded: torch.Tensor) -> None:
    _copy(param, loaded)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"weight shape mismatch: parameter {tuple(dst.shape)} vs checkpoint {tuple(src.shape)}"
        )
    with torch.no_grad():
        dst.copy_(src)
