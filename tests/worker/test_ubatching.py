"""Micro-batch forwards take turns at each collective: with real gloo all-reduces (a
one-rank group in this process), the two forwards alternate collective by collective,
each sees its own forward context at every turn, the outer context comes back, and a
failing micro-batch lets the other finish before its error is raised."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from kvserve.forward_context import (
    NO_UBATCH,
    current_ubatch,
    get_forward_context,
    set_forward_context,
)
from kvserve.worker.ubatching import UBatchThreads

NUM_LAYERS = 3


@pytest.fixture(scope="module")
def gloo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dist.ProcessGroup]:
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialised in this process")
    store = Path(tmp_path_factory.mktemp("gloo")) / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", world_size=1, rank=0)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def threads() -> Iterator[UBatchThreads]:
    pool = UBatchThreads()
    yield pool
    pool.shutdown()


def _forward(
    name: str, group: dist.ProcessGroup, log: list[tuple[str, int, str]], fail_at: int = -1
) -> Callable[[], int]:
    """A stand-in model: NUM_LAYERS layers, each ending in an all-reduce."""

    def forward() -> int:
        total = 0
        for layer in range(NUM_LAYERS):
            if layer == fail_at:
                raise RuntimeError(f"{name} failed")
            log.append((name, layer, get_forward_context().attn_metadata))
            partial = torch.full((4,), float(layer + 1))
            current_ubatch().overlap(
                lambda async_op, t=partial: dist.all_reduce(t, group=group, async_op=async_op)
            )
            total += int(partial.sum())  # the reduction has completed when overlap returns
        return total

    return forward


def test_micro_batches_alternate_at_each_collective(
    gloo: dist.ProcessGroup, threads: UBatchThreads
) -> None:
    log: list[tuple[str, int, str]] = []
    with torch.inference_mode(), set_forward_context("whole step") as outer:
        results = threads.run(
            outer, ["md0", "md1"], [_forward("u0", gloo, log), _forward("u1", gloo, log)]
        )
        assert get_forward_context() is outer and current_ubatch() is NO_UBATCH
    assert results == [24, 24]  # 4 * (1 + 2 + 3) each
    assert log == [
        (name, layer, md)
        for layer in range(NUM_LAYERS)
        for name, md in (("u0", "md0"), ("u1", "md1"))
    ]


@pytest.mark.parametrize("failing", [0, 1])
def test_a_failing_micro_batch_lets_the_other_finish(
    gloo: dist.ProcessGroup, threads: UBatchThreads, failing: int
) -> None:
    log: list[tuple[str, int, str]] = []
    forwards = [_forward(f"u{i}", gloo, log, fail_at=1 if i == failing else -1) for i in range(2)]
    with set_forward_context("whole step") as outer:
        with pytest.raises(RuntimeError, match=f"u{failing} failed"):
            threads.run(outer, ["md0", "md1"], forwards)
        assert get_forward_context() is outer
    other = f"u{1 - failing}"
    assert [layer for name, layer, _ in log if name == other] == list(range(NUM_LAYERS))
