"""parallel_state over real torch.distributed gloo groups: four spawned processes as
TP=2 x PP=2, each checking the collectives' results for its own rank."""

from __future__ import annotations

import multiprocessing
import socket

import pytest
import torch

from kvserve.distributed import parallel_state as ps


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world: int, init_method: str) -> None:
    torch.set_num_threads(1)
    ps.init_distributed_environment(world, rank, init_method)
    ps.initialize_model_parallel(tensor_parallel_size=2, pipeline_parallel_size=2)
    tp, pp = ps.get_tp_group(), ps.get_pp_group()
    # rank = pp_rank * tp_size + tp_rank: TP groups are runs, PP groups strides.
    assert tp.ranks == ([0, 1] if rank < 2 else [2, 3])
    assert pp.ranks == ([0, 2] if rank % 2 == 0 else [1, 3])
    assert ps.get_tensor_model_parallel_rank() == rank % 2
    assert ps.get_tensor_model_parallel_world_size() == 2
    assert pp.is_first_rank == (rank < 2) and pp.is_last_rank == (rank >= 2)

    x = torch.full((2, 3), float(rank + 1))
    assert torch.equal(ps.tensor_model_parallel_all_reduce(x.clone()), x * 0 + sum(tp.ranks) + 2)
    gathered = ps.tensor_model_parallel_all_gather(torch.tensor([[rank]]), dim=-1)
    assert gathered.tolist() == [tp.ranks]
    on_first = tp.gather(torch.tensor([rank * 10]), dst=0, dim=0)
    assert (on_first.tolist() if on_first is not None else None) == (
        [r * 10 for r in tp.ranks] if tp.is_first_rank else None
    )
    b = tp.broadcast(torch.tensor([rank, rank]), src=1)
    assert b.tolist() == [tp.ranks[1]] * 2
    world_sum = ps.get_world_group().all_reduce(torch.ones(1))
    assert world_sum.item() == world

    # Stage to stage: a dict of tensors of several dtypes down the PP group.
    if pp.is_first_rank:
        pp.send_tensor_dict({
            "hidden_states": torch.arange(6, dtype=torch.float32).reshape(2, 3) + rank,
            "residual": torch.tensor([rank], dtype=torch.int64),
            "half": torch.ones(4, dtype=torch.bfloat16),
        })  # fmt: skip
    else:
        got = pp.recv_tensor_dict()
        sender = pp.prev_rank
        assert list(got) == ["hidden_states", "residual", "half"]
        assert torch.equal(got["hidden_states"], torch.arange(6.0).reshape(2, 3) + sender)
        assert got["residual"].tolist() == [sender] and got["half"].dtype == torch.bfloat16
    ps.destroy_distributed_environment()
    assert not torch.distributed.is_initialized()
    # Torn down, the process is a single rank again: collectives return their input.
    assert ps.get_tp_group().world_size == 1 and not ps.model_parallel_is_initialized()
    ps.destroy_distributed_environment()  # twice is harmless


def test_groups_and_collectives_across_four_processes() -> None:
    ctx = multiprocessing.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_rank_main, args=(r, 4, init_method)) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0, 0, 0, 0]


def test_a_single_process_has_one_rank_groups() -> None:
    x = torch.ones(3)
    assert ps.get_tp_group().world_size == 1
    assert ps.tensor_model_parallel_all_reduce(x) is x
    assert ps.tensor_model_parallel_all_gather(x) is x
    with pytest.raises(RuntimeError, match="not initialised"):
        ps.get_world_group()


def test_bad_layouts_are_refused() -> None:
    with pytest.raises(ValueError, match="rank 3 is outside world_size 2"):
        ps.init_distributed_environment(2, 3, "tcp://127.0.0.1:1")
    with pytest.raises(RuntimeError, match="init_distributed_environment"):
        ps.initialize_model_parallel(2, 1)


def test_group_layouts_with_data_and_expert_parallelism() -> None:
    """vLLM's layout, rank = (dp_rank * pp + pp_rank) * tp + tp_rank: a DP group takes one
    (pp, tp) position from every core, an EP group every core's TP ranks of one stage."""
    layouts = ps.group_layouts(2, 1, 2, enable_expert_parallel=True)
    assert layouts == {
        "tp": [[0, 1], [2, 3]],
        "pp": [[0], [1], [2], [3]],
        "dp": [[0, 2], [1, 3]],
        "ep": [[0, 1, 2, 3]],
    }
    layouts = ps.group_layouts(2, 2, 2)
    assert layouts["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layouts["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layouts["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert "ep" not in layouts  # expert parallelism off
    # One core: no DP group; expert parallelism shares the experts over its TP ranks.
    assert ps.group_layouts(2, 1, 1, enable_expert_parallel=True) == {
        "tp": [[0, 1]],
        "pp": [[0], [1]],
        "ep": [[0, 1]],
    }
