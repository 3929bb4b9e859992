"""Process groups for tensor and pipeline parallelism, over torch.distributed.

Every rank runs the same model code; a ``GroupCoordinator`` wraps the ranks that work on
one thing together (a TP group shares each layer, a PP group passes activations along)
with two torch.distributed groups: a gloo ``cpu_group`` for metadata and CPU tensors, and
a ``device_group`` for the activations (NCCL on CUDA, the gloo group itself on a CPU).
All-reduces of CPU float tensors skip gloo where every rank of the group shares this
host's shared memory (shm_all_reduce.py): gloo over localhost TCP costs more system CPU
per reduction than a small model's layer computes.

Ranks are laid out as vLLM does: ``rank = (dp_rank * pp_size + pp_rank) * tp_size +
tp_rank``, so a TP group is a run of consecutive ranks and a PP group takes one rank from
each run. Workers of several data-parallel cores share one world only with expert
parallelism; then a DP group takes the same (pp, tp) position from every core and an EP
group is every core's TP group of one pipeline stage (DP x TP ranks).

Nothing here is initialised in a single-process engine: ``get_tp_group()`` then answers
with a one-rank stand-in whose collectives return their input, so layers that ask for
their rank pay nothing on the default path.

Metadata between ranks (``send_tensor_dict``) is msgpack with explicit tensor headers,
never pickle (torch's ``*_object`` collectives pickle).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from kvserve.config import ParallelConfig
from kvserve.distributed import shm_all_reduce
from kvserve.forward_context import current_ubatch

logger = logging.getLogger(__name__)

# How long a rank waits in a collective for the others before it gives up (a rank that
# died is caught sooner by the executor, which watches the processes).
COLLECTIVE_TIMEOUT_S = float(os.environ.get("KVSERVE_COLLECTIVE_TIMEOUT", "300"))


class TensorHeader(msgspec.Struct, array_like=True):
    """One tensor of a dict sent between ranks: its key, dtype name and shape."""

    key: str
    dtype: str
    shape: list[int]


_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(list[TensorHeader])


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


class GroupCoordinator:
    """The collectives of one group of ranks. ``ranks`` are global ranks, in group order."""

    def __init__(self, ranks: list[int], name: str, device: torch.device) -> None:
        self.name = name
        self.ranks = ranks
        self.world_size = len(ranks)
        self.device = device
        self.cpu_group: dist.ProcessGroup | None = None
        self.device_group: dist.ProcessGroup | None = None
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.rank_in_group = ranks.index(self.rank) if self.rank in ranks else 0
        # The shared-memory all-reduce, set up by the first all-reduce of a CPU tensor
        # (a collective, which every rank reaches at the same point); None keeps gloo.
        self._shm: shm_all_reduce.ShmAllReduce | None = None
        self._shm_tried = False

    @classmethod
    def single(cls, name: str) -> GroupCoordinator:
        """The group of a process that runs alone (no torch.distributed at all)."""
        return cls([0], name, torch.device("cpu"))

    @property
    def first_rank(self) -> int:
        return self.ranks[0]

    @property
    def last_rank(self) -> int:
        return self.ranks[-1]

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    @property
    def uses_shared_memory(self) -> bool:
        """Whether CPU all-reduces go through shared memory (known after the first)."""
        return self._shm is not None

    def _group_for(self, tensor: torch.Tensor) -> dist.ProcessGroup | None:
        return self.cpu_group if tensor.device.type == "cpu" else self.device_group

    # ---- collectives (each returns its input unchanged in a one-rank group) ---------

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place (the input is returned). CPU tensors of the
        float types go through shared memory where every rank is on this host (see
        shm_all_reduce.py); the rest through torch.distributed."""
        if self.world_size == 1:
            return tensor
        shm = self._shared_memory() if shm_all_reduce.ShmAllReduce.supports(tensor) else None
        if shm is not None:
            # Done when issued, so a micro-batch (dual batch overlap) gets finished work
            # and still hands its turn on here: the turns, and with them the order of
            # every rank's collectives, stay as they are with gloo.
            current_ubatch().overlap(lambda async_op: shm.all_reduce(tensor))
            return tensor
        group = self._group_for(tensor)
        # Inside a micro-batch (dual batch overlap) the reduction runs while the other
        # micro-batch computes; otherwise it completes here.
        current_ubatch().overlap(
            lambda async_op: dist.all_reduce(tensor, group=group, async_op=async_op)
        )
        return tensor

    def _shared_memory(self) -> shm_all_reduce.ShmAllReduce | None:
        if not self._shm_tried:
            self._shm_tried = True
            assert self.cpu_group is not None, f"the {self.name} group has no CPU group"
            self._shm = shm_all_reduce.connect(
                self.cpu_group, self.ranks, self.rank_in_group, COLLECTIVE_TIMEOUT_S
            )
        return self._shm

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's tensor concatenated along ``dim``, in group order."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self._group_for(tensor))
        return torch.cat(parts, dim=dim)

    def gather(self, tensor: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """The concatenation on group rank ``dst``; None on the others."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        is_dst = self.rank_in_group == dst
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)] if is_dst else None
        dist.gather(tensor, parts, dst=self.ranks[dst], group=self._group_for(tensor))
        return torch.cat(parts, dim=dim) if parts is not None else None

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Group rank ``src``'s tensor on every rank, in place."""
        if self.world_size == 1:
            return tensor
        dist.broadcast(tensor, src=self.ranks[src], group=self._group_for(tensor))
        return tensor

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)

    # ---- point to point: a dict of tensors, its layout sent first as msgpack ---------

    def send_tensor_dict(self, tensors: dict[str, torch.Tensor], dst: int | None = None) -> None:
        """Send to group rank ``dst`` (default: the next rank) the dict's layout (one
        length-prefixed msgpack frame on the CPU group), then each tensor."""
        peer = self.ranks[dst] if dst is not None else self.next_rank
        headers = [
            TensorHeader(key, str(t.dtype).removeprefix("torch."), list(t.shape))
            for key, t in tensors.items()
        ]
        frame = torch.frombuffer(bytearray(_encoder.encode(headers)), dtype=torch.uint8)
        dist.send(torch.tensor([frame.numel()], dtype=torch.int64), peer, group=self.cpu_group)
        dist.send(frame, peer, group=self.cpu_group)
        for t in tensors.values():
            dist.send(t.contiguous(), peer, group=self._group_for(t))

    def recv_tensor_dict(self, src: int | None = None) -> dict[str, torch.Tensor]:
        peer = self.ranks[src] if src is not None else self.prev_rank
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, peer, group=self.cpu_group)
        frame = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(frame, peer, group=self.cpu_group)
        out: dict[str, torch.Tensor] = {}
        for header in _header_decoder.decode(frame.numpy().tobytes()):
            t = torch.empty(header.shape, dtype=_dtype(header.dtype), device=self.device)
            dist.recv(t, peer, group=self._group_for(t))
            out[header.key] = t
        return out

    def destroy(self) -> None:
        for group in {id(g): g for g in (self.cpu_group, self.device_group) if g}.values():
            dist.destroy_process_group(group)
        self.cpu_group = self.device_group = None
        self._shm, self._shm_tried = None, True


@dataclass
class _State:
    world: GroupCoordinator | None = None
    tp: GroupCoordinator | None = None
    pp: GroupCoordinator | None = None
    dp: GroupCoordinator | None = None
    ep: GroupCoordinator | None = None


_state = _State()
_SINGLE_TP = GroupCoordinator.single("tp")
_SINGLE_PP = GroupCoordinator.single("pp")
_SINGLE_DP = GroupCoordinator.single("dp")
_SINGLE_EP = GroupCoordinator.single("ep")


def _env_int(name: str, value: int | None, default: int | None = None) -> int:
    if value is not None:
        return value
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise ValueError(f"{name} is not set and was not given")
        return default
    return int(raw)


def init_distributed_environment(
    world_size: int | None = None,
    rank: int | None = None,
    distributed_init_method: str | None = None,
    local_rank: int = 0,
    backend: str = "gloo",
    device: torch.device | None = None,
) -> GroupCoordinator:
    """Join the default process group. Unset arguments come from the environment
    (``WORLD_SIZE``, ``RANK``, and ``MASTER_ADDR``/``MASTER_PORT`` through ``env://``),
    as torchrun sets them. ``backend``: ``gloo`` on CPU, ``nccl`` for CUDA tensors (the
    CPU group is gloo either way)."""
    world_size = _env_int("WORLD_SIZE", world_size, 1)
    rank = _env_int("RANK", rank, 0)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    init_method = distributed_init_method or "env://"
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            world_size=world_size,
            rank=rank,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
    world = GroupCoordinator(list(range(world_size)), "world", device or torch.device("cpu"))
    world.cpu_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")
    world.device_group = dist.group.WORLD
    _state.world = world
    return world


def _new_groups(
    layouts: list[list[int]], name: str, device: torch.device, device_backend: str
) -> GroupCoordinator:
    """Every rank creates every group (torch.distributed requires it) and keeps its own."""
    mine: GroupCoordinator | None = None
    rank = dist.get_rank()
    for ranks in layouts:
        cpu = dist.new_group(ranks, backend="gloo")
        dev = cpu if device_backend == "gloo" else dist.new_group(ranks, backend=device_backend)
        if rank in ranks:
            mine = GroupCoordinator(ranks, name, device)
            mine.cpu_group, mine.device_group = cpu, dev
    assert mine is not None, f"rank {rank} is in no {name} group"
    return mine


def group_layouts(
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    data_parallel_size: int = 1,
    enable_expert_parallel: bool = False,
) -> dict[str, list[list[int]]]:
    """The global ranks of every group, by kind: TP groups (consecutive ranks) and PP
    groups (strided) within each data-parallel block of ``tp x pp`` ranks; DP groups (one
    rank per block) when there are several blocks; EP groups (every block's TP ranks of
    one stage) with expert parallelism over more than one rank."""
    tp, pp, dp = tensor_parallel_size, pipeline_parallel_size, data_parallel_size

    def rank(d: int, p: int, t: int) -> int:
        return (d * pp + p) * tp + t

    layouts = {
        "tp": [[rank(d, p, t) for t in range(tp)] for d in range(dp) for p in range(pp)],
        "pp": [[rank(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
    }
    if dp > 1:
        layouts["dp"] = [[rank(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)]
    if enable_expert_parallel and dp * tp > 1:
        layouts["ep"] = [[rank(d, p, t) for d in range(dp) for t in range(tp)] for p in range(pp)]
    return layouts


def initialize_model_parallel(
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    data_parallel_size: int = 1,
    enable_expert_parallel: bool = False,
) -> None:
    """Creates this rank's groups of ``group_layouts`` (every rank creates every group,
    in the same order, as torch.distributed requires)."""
    world = _state.world
    if world is None:
        raise RuntimeError("init_distributed_environment() must run first")
    tp, pp, dp = tensor_parallel_size, pipeline_parallel_size, data_parallel_size
    if tp * pp * dp != world.world_size:
        raise ValueError(
            f"tensor_parallel_size ({tp}) x pipeline_parallel_size ({pp}) x "
            f"data_parallel_size ({dp}) != world size ({world.world_size})"
        )
    backend = str(dist.get_backend())
    layouts = group_layouts(tp, pp, dp, enable_expert_parallel)
    groups = {
        name: _new_groups(ranks, name, world.device, backend) for name, ranks in layouts.items()
    }
    _state.tp, _state.pp = groups["tp"], groups["pp"]
    _state.dp, _state.ep = groups.get("dp"), groups.get("ep")


def init_worker_distributed_environment(
    parallel_config: ParallelConfig,
    rank: int,
    distributed_init_method: str | None,
    device: torch.device,
) -> None:
    """A worker's groups: the world (NCCL for CUDA tensors, gloo otherwise), then TP/PP,
    and DP/EP. ``rank`` is the worker's rank within its engine core; with expert
    parallelism across cores the world spans them all and meets at the front end's
    address (ParallelConfig.data_parallel_address / data_parallel_master_port)."""
    dp = parallel_config.data_parallel_size if parallel_config.expert_parallel_across_dp else 1
    if dp > 1:
        port = parallel_config.data_parallel_master_port
        if port is None:
            raise ValueError("data_parallel_master_port must be set (the front end picks one)")
        rank += parallel_config.data_parallel_rank * parallel_config.world_size
        address = parallel_config.data_parallel_address or "127.0.0.1"
        distributed_init_method = f"tcp://{address}:{port}"
    init_distributed_environment(
        parallel_config.distributed_world_size,
        rank,
        distributed_init_method,
        backend="nccl" if device.type == "cuda" else "gloo",
        device=device,
    )
    initialize_model_parallel(
        parallel_config.tensor_parallel_size,
        parallel_config.pipeline_parallel_size,
        dp,
        parallel_config.enable_expert_parallel,
    )


def model_parallel_is_initialized() -> bool:
    return _state.tp is not None


def get_world_group() -> GroupCoordinator:
    if _state.world is None:
        raise RuntimeError("the distributed environment is not initialised")
    return _state.world


def get_tp_group() -> GroupCoordinator:
    return _state.tp or _SINGLE_TP


def get_pp_group() -> GroupCoordinator:
    return _state.pp or _SINGLE_PP


def get_dp_group() -> GroupCoordinator:
    """The workers at this one's (pp, tp) position in every data-parallel core (one rank
    unless expert parallelism joins the cores)."""
    return _state.dp or _SINGLE_DP


def get_ep_group() -> GroupCoordinator:
    """The ranks this one shares the experts with (one rank without expert parallelism)."""
    return _state.ep or _SINGLE_EP


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def get_pp_layer_range(num_layers: int) -> tuple[int, int]:
    """``[start, end)`` of the decoder layers this pipeline stage runs: an even split,
    the first ``num_layers % pp`` stages taking one more."""
    pp = get_pp_group()
    if num_layers < pp.world_size:
        raise ValueError(
            f"pipeline_parallel_size={pp.world_size} exceeds num_hidden_layers={num_layers}"
        )
    base, extra = divmod(num_layers, pp.world_size)
    rank = pp.rank_in_group
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def tensor_model_parallel_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    return get_tp_group().all_reduce(tensor)


def tensor_model_parallel_all_gather(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return get_tp_group().all_gather(tensor, dim)


def destroy_model_parallel() -> None:
    for group in (_state.tp, _state.pp, _state.dp, _state.ep):
        if group is not None:
            group.destroy()
    _state.tp = _state.pp = _state.dp = _state.ep = None


def destroy_distributed_environment() -> None:
    """Leave every group and the default one; safe to call twice."""
    destroy_model_parallel()
    _state.world = None
    if dist.is_initialized():
        dist.destroy_process_group()
