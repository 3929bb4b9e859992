"""The shared-memory all-reduce across real processes: sums equal to the rank-order sum
(and the float64 sum within rounding), identical bits on every rank, tensors larger than
a slot, many reductions back to back, gloo where it is switched off, and an error, not a
hang, when a peer is gone."""

from __future__ import annotations

import multiprocessing
import os
import socket
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kvserve.distributed import parallel_state as ps
from kvserve.distributed import shm_all_reduce
from tests.kernel_support import require_kernels

require_kernels()

# Small slots so that a few thousand elements already take several rounds.
SLOT_BYTES = 4096
SIZES = [1, 7, 576, 1000, 1024, 64 * 576, 3 * SLOT_BYTES + 5]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _input(rank: int, size: int, dtype: torch.dtype, case: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * case + rank)
    # Mixed magnitudes, so the order of the additions shows in the rounding.
    x = torch.randn(size, generator=g, dtype=torch.float64) * torch.exp(
        torch.randn(size, generator=g, dtype=torch.float64) * 2
    )
    return x.to(dtype)


def _rank_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    acc_dtype = torch.float64 if parts[0].dtype == torch.float64 else torch.float32
    acc = parts[0].to(acc_dtype)
    for p in parts[1:]:
        acc = acc + p.to(acc_dtype)
    return acc.to(parts[0].dtype)


def _same_on_every_rank(x: torch.Tensor, world: int) -> bool:
    raw = x.contiguous().view(torch.uint8)
    parts = [torch.empty_like(raw) for _ in range(world)]
    dist.all_gather(parts, raw)
    return all(torch.equal(p, parts[0]) for p in parts)


def _check(x: torch.Tensor, world: int, size: int, dtype: torch.dtype, case: int) -> None:
    parts = [_input(r, size, dtype, case) for r in range(world)]
    assert torch.equal(x, _rank_order_sum(parts)), (size, dtype, case)
    exact = sum(p.to(torch.float64) for p in parts)
    magnitude = sum(p.to(torch.float64).abs() for p in parts)
    eps = torch.finfo(torch.float32 if dtype != torch.float64 else dtype).eps
    # world - 1 roundings in the accumulator, then one into the dtype (whose step is
    # fixed among the subnormals).
    info = torch.finfo(dtype)
    bound = (world - 1) * eps * magnitude + info.eps * exact.abs() + info.tiny * info.eps
    error = (x.to(torch.float64) - exact).abs()
    assert bool((error <= bound * 1.01).all()), (size, dtype, float((error / bound).max()))


def _sums_main(rank: int, world: int, init_method: str, results: Any) -> None:
    torch.set_num_threads(1)
    ps.init_distributed_environment(world, rank, init_method)
    ps.initialize_model_parallel(tensor_parallel_size=world)
    group = ps.get_world_group().cpu_group
    assert group is not None
    shm = shm_all_reduce.connect(group, list(range(world)), rank, 30.0, SLOT_BYTES)
    assert shm is not None
    # The name is gone from /dev/shm once every rank mapped the segment (rank 0 removes
    # it, the others may look before it did).
    if rank == 0:
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"kvserve-ar-{os.getpid()}-")]
    case = 0
    for dtype in DTYPES:
        for size in SIZES:
            x = _input(rank, size, dtype, case)
            shm.all_reduce(x)
            _check(x, world, size, dtype, case)
            assert _same_on_every_rank(x, world)
            case += 1
    # Back to back, no other synchronisation between them: the double buffering alone
    # keeps a fast rank from overwriting a slot a slow one still reads.
    outputs = []
    for i in range(300):
        size = SIZES[i % len(SIZES)]
        x = _input(rank, size, torch.float32, case + i)
        shm.all_reduce(x)
        outputs.append(x)
    for i, x in enumerate(outputs):
        _check(x, world, SIZES[i % len(SIZES)], torch.float32, case + i)
    # A strided view is reduced in place too.
    base = _input(rank, 2 * 576, torch.float32, 9999).reshape(576, 2)
    view = base[:, 0]
    shm.all_reduce(view)
    expected = _rank_order_sum(
        [_input(r, 2 * 576, torch.float32, 9999).reshape(576, 2)[:, 0] for r in range(world)]
    )
    assert torch.equal(base[:, 0], expected)

    # Through the TP group: shared memory by default, default slot size (1 MiB), a
    # tensor larger than that, integers still through gloo.
    tp = ps.get_tp_group()
    big = _input(rank, (1 << 20) // 4 + 3, torch.float32, 77)
    tp.all_reduce(big)
    assert tp.uses_shared_memory
    _check(big, world, (1 << 20) // 4 + 3, torch.float32, 77)
    counts = tp.all_reduce(torch.tensor([rank, 1], dtype=torch.int64))
    assert counts.tolist() == [sum(range(world)), world]
    ps.destroy_distributed_environment()
    results.put((rank, "ok"))


def _spawn(target: Any, world: int, *args: Any, env: dict[str, str] | None = None) -> list[Any]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        procs = [
            ctx.Process(target=target, args=(r, world, init_method, results, *args))
            for r in range(world)
        ]
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    for p in procs:
        p.join(120)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0] * world
    return sorted(results.get(timeout=5) for _ in range(world))


@pytest.mark.parametrize("world", [2, 3])
def test_sums_are_exact_in_rank_order_and_identical_on_every_rank(world: int) -> None:
    assert _spawn(_sums_main, world) == [(r, "ok") for r in range(world)]


def _switched_off_main(rank: int, world: int, init_method: str, results: Any) -> None:
    ps.init_distributed_environment(world, rank, init_method)
    ps.initialize_model_parallel(tensor_parallel_size=world)
    tp = ps.get_tp_group()
    x = tp.all_reduce(torch.full((576,), float(rank + 1)))
    assert torch.equal(x, torch.full((576,), 3.0))
    results.put((rank, tp.uses_shared_memory))
    ps.destroy_distributed_environment()


def test_env_switch_keeps_gloo() -> None:
    got = _spawn(_switched_off_main, 2, env={shm_all_reduce.ENV_SHM_ALL_REDUCE: "0"})
    assert got == [(0, False), (1, False)]


def _dead_peer_main(rank: int, world: int, init_method: str, results: Any) -> None:
    ps.init_distributed_environment(world, rank, init_method)
    group = ps.get_world_group().cpu_group
    assert group is not None
    shm = shm_all_reduce.connect(group, list(range(world)), rank, 1.0, SLOT_BYTES)
    assert shm is not None
    shm.all_reduce(torch.ones(10))
    if rank == 1:
        outcome = "left"  # gone without a word below, as a crashed process
    else:
        try:
            shm.all_reduce(torch.ones(10))
            outcome = "no error"
        except RuntimeError as exc:
            outcome = str(exc)
    results.put((rank, outcome))
    results.close()
    results.join_thread()
    os._exit(0)  # the default group's teardown would wait for the dead peer


def test_dead_peer_gives_an_error_not_a_hang() -> None:
    got = dict(_spawn(_dead_peer_main, 2))
    assert got[1] == "left"
    assert "waited 1 s for rank 1 of 2" in got[0] and "died" in got[0], got[0]
