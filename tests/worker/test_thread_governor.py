"""The step thread governor: probes the other thread count, switches only when it is
clearly faster, backs off while probes confirm the choice, and probes again at once when
steps slow down. Steps here sleep for a time that depends on torch's thread count at the
moment they run, the one thing the governor controls; long enough that a loaded
machine's scheduling jitter stays well under the governor's margins."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvserve.worker import thread_governor as tg
from kvserve.worker.thread_governor import StepThreadGovernor


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _run(gov: StepThreadGovernor, steps: int, seconds: Callable[[int], float]) -> list[int]:
    """Runs `steps` one-token steps; returns the thread count each ran with."""
    used = []
    for _ in range(steps):
        gov.begin(1)
        threads = torch.get_num_threads()
        used.append(threads)
        time.sleep(seconds(threads))
        gov.end()
    return used


def test_switches_to_one_thread_when_it_is_faster_and_back_when_it_is_not() -> None:
    torch.set_num_threads(2)
    gov = StepThreadGovernor(2)
    contended = _run(gov, 12, lambda t: 0.1 if t == 2 else 0.01)
    assert contended[: tg.FIRST_PROBE_AFTER] == [2] * tg.FIRST_PROBE_AFTER
    assert gov.current == 1 and contended[-1] == 1
    quiet = _run(gov, 2 * tg.FIRST_PROBE_AFTER + 2, lambda t: 0.04 if t == 2 else 0.08)
    assert gov.current == 2 and quiet[-1] == 2


def test_probes_back_off_while_they_confirm_the_choice() -> None:
    torch.set_num_threads(2)
    gov = StepThreadGovernor(2)
    used = _run(gov, 60, lambda t: 0.02 if t == 2 else 0.08)
    probes = [i for i, t in enumerate(used) if t == 1]
    assert gov.current == 2
    # After 8 steps, then 16 more, then 32 more: the intervals double.
    assert probes == [8, 25, 58]


def test_a_sudden_slowdown_probes_at_once() -> None:
    torch.set_num_threads(2)
    gov = StepThreadGovernor(2)
    _run(gov, 30, lambda t: 0.02 if t == 2 else 0.08)  # interval now 32
    slow = _run(gov, 4, lambda t: 0.1 if t == 2 else 0.01)
    assert slow == [2, 2, 1, 1] and gov.current == 1


def test_a_single_slow_step_changes_nothing() -> None:
    # A hiccup (one step 7x its usual time) is no change of regime: no probe, no switch,
    # and the running mean does not take it in.
    torch.set_num_threads(2)
    gov = StepThreadGovernor(2)
    _run(gov, 30, lambda t: 0.02 if t == 2 else 0.05)  # interval now 32
    usual = gov._cost[(2, 1)]
    hiccups = iter([0.14] + [0.02] * 5)
    used = _run(gov, 6, lambda t: next(hiccups) if t == 2 else 0.05)
    assert used == [2] * 6 and gov.current == 2
    assert gov._cost[(2, 1)] < 1.5 * usual


def test_disabled_or_single_core_never_touches_threads() -> None:
    torch.set_num_threads(2)
    for gov in (StepThreadGovernor(2, enabled=False), StepThreadGovernor(1)):
        used = _run(gov, 20, lambda t: 0.01 if t == 2 else 0.0)
        assert used == [2] * 20
