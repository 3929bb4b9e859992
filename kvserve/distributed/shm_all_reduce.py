"""All-reduce of CPU tensors through shared memory, for a group whose ranks share a host.

gloo over TCP on localhost costs ~100 syscalls and 0.6-0.9 ms of system CPU per rank for
one 576-float all-reduce, and a decode step of SmolLM2-135M runs ~61 of them: for small
models tensor parallelism's own overhead outweighed the work it splits. The ranks of a
group on one host instead share a POSIX shared-memory segment and reduce through it
(csrc/shm_all_reduce.cpp): a copy in, a flag, a wait, and a sum in rank order that gives
every rank identical bits.

``connect`` sets a segment up over the group's gloo ``cpu_group``: the ranks check they
all want it and run on one host (hostname and boot id), group rank 0 creates the segment
under a random name and broadcasts it, the others open it, and once all say they mapped
it the name is unlinked, so nothing stays in /dev/shm even if a process dies. Ranks that
do not share /dev/shm (other hosts, other containers) fail to open it, and the group
keeps gloo. ``KVSERVE_SHM_ALL_REDUCE=0`` keeps gloo too (for A/B comparisons).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from typing import Any

import torch
import torch.distributed as dist

from kvserve import _custom_ops as ops

logger = logging.getLogger(__name__)

ENV_SHM_ALL_REDUCE = "KVSERVE_SHM_ALL_REDUCE"
# Bytes of one rank's slot: a tensor larger than this goes in several rounds. 1 MiB holds
# a decode step's activations many times over; the segment is 2 x ranks x slot.
SLOT_BYTES = 1 << 20
DTYPES = frozenset({torch.float32, torch.float64, torch.bfloat16, torch.float16})
_HOST_BYTES = 256
_NAME_BYTES = 64


def enabled() -> bool:
    return os.environ.get(ENV_SHM_ALL_REDUCE, "1") not in ("0", "false", "off", "")


def _host_id() -> bytes:
    """Names this host's kernel: the hostname alone can repeat across machines."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
    except OSError:
        boot = b""
    return (socket.gethostname().encode() + b"/" + boot)[:_HOST_BYTES]


def _padded(data: bytes, size: int) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.uint8)
    if data:
        out[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


class _Done:
    """The finished work of a reduction that completed when it was issued."""

    def wait(self) -> bool:
        return True


DONE = _Done()


class ShmAllReduce:
    """One group's segment; ``all_reduce`` must be called by every rank in the same order
    (as any collective), from one thread at a time."""

    def __init__(self, handle: Any) -> None:
        # torch.classes.kvserve.ShmAllReduce (a ScriptObject, untyped for mypy).
        self._handle = handle

    @staticmethod
    def supports(tensor: torch.Tensor) -> bool:
        return tensor.is_cpu and tensor.dtype in DTYPES

    def all_reduce(self, tensor: torch.Tensor) -> _Done:
        """Sums ``tensor`` over the group in place; returns finished work, for the
        callers that expect a handle to wait on."""
        if tensor.is_contiguous():
            self._handle.all_reduce(tensor)
        else:
            flat = tensor.contiguous()
            self._handle.all_reduce(flat)
            tensor.copy_(flat)
        return DONE


def connect(
    cpu_group: dist.ProcessGroup,
    ranks: list[int],
    rank_in_group: int,
    timeout_s: float,
    slot_bytes: int = SLOT_BYTES,
) -> ShmAllReduce | None:
    """A segment shared by the group's ranks, or None where any of them cannot take part
    (then every rank gets None). Collective over ``cpu_group``: every rank calls it.
    ``ranks`` are the group's global ranks in group order."""
    world = len(ranks)
    wanted = enabled() and ops.available()
    mine = torch.cat(
        [torch.tensor([int(wanted)], dtype=torch.uint8), _padded(_host_id(), _HOST_BYTES)]
    )
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=cpu_group)
    if not all(int(t[0]) for t in everyone) or any(
        not torch.equal(t[1:], everyone[0][1:]) for t in everyone
    ):
        return None

    handle: Any = None
    name = ""
    if rank_in_group == 0:
        name = f"/kvserve-ar-{os.getpid()}-{secrets.token_hex(8)}"
        try:
            handle = ops.shm_all_reduce(name, True, 0, world, slot_bytes, timeout_s)
        except RuntimeError as exc:
            logger.warning("shared-memory all-reduce unavailable, using gloo: %s", exc)
            name = ""
    sent = _padded(name.encode(), _NAME_BYTES)
    dist.broadcast(sent, src=ranks[0], group=cpu_group)
    name = bytes(sent.tolist()).rstrip(b"\0").decode()
    try:
        if name and rank_in_group != 0:
            try:
                handle = ops.shm_all_reduce(
                    name, False, rank_in_group, world, slot_bytes, timeout_s
                )
            except RuntimeError as exc:
                logger.info("shared-memory all-reduce: %s; the group keeps gloo", exc)
        mapped = torch.tensor([int(handle is not None)], dtype=torch.int32)
        dist.all_reduce(mapped, op=dist.ReduceOp.MIN, group=cpu_group)
    finally:
        if rank_in_group == 0 and handle is not None:
            handle.unlink()
    if not int(mapped.item()):
        return None
    assert handle is not None
    logger.debug("all-reduce over shared memory for %d ranks (group rank %d)", world, rank_in_group)
    return ShmAllReduce(handle)
