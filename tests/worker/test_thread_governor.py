"""The step thread governor: probes the other thread count, switches only when it is
clearly faster, backs off while probes confirm the choice, probes again at once when
steps slow down (or, on one thread, speed up), and keeps all of that per step size.
Steps here sleep for a time that depends on torch's thread count at the moment they
run, the one thing the governor controls; long enough that a loaded machine's
scheduling jitter stays well under the governor's margins."""

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


def _run(
    gov: StepThreadGovernor, steps: int, seconds: Callable[[int], float], num_tokens: int = 1
) -> list[int]:
    """Runs `steps` steps of `num_tokens`; returns the thread count each ran with."""
    used = []
    for _ in range(steps):
        gov.begin(num_tokens)
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
    assert gov.threads_for(1) == 1 and contended[-1] == 1
    quiet = _run(gov, 2 * tg.FIRST_PROBE_AFTER + 2, lambda t: 0.04 if t == 2 else 0.08)
    assert gov.threads_for(1) == 2 and quiet[-1] == 2


def test_probes_back_off_while_they_confirm_the_choice() -> None:
    torch.set_num_threads(2)
    gov = StepThreadGovernor(2)
    used = _run(gov, 60, lambda t: 0.02 if t == 2 else 0.08)
    probes = [i for i, t in enumerate(used) if t == 1]
    assert gov.threads_for(1) == 2
    # After 8 steps, then 16 more, then 32 more: the intervals double.
    assert probes == [8, 25, 58]


def test_a_sudden_slowdown_probes_at_once() -> None:
    torch.set_num_threads(2)
    gov = StepThreadGovernor(2)
    _run(gov, 30, lambda t: 0.02 if t == 2 else 0.08)  # interval now 32
    slow = _run(gov, 4, lambda t: 0.1 if t == 2 else 0.01)
    assert slow == [2, 2, 1, 1] and gov.threads_for(1) == 1


def test_a_single_slow_step_changes_nothing() -> None:
    # A hiccup (one step 7x its usual time) is no change of regime: no probe, no switch,
    # and the running mean does not take it in.
    torch.set_num_threads(2)
    gov = StepThreadGovernor(2)
    _run(gov, 30, lambda t: 0.02 if t == 2 else 0.05)  # interval now 32
    usual = gov._sizes[1].cost[2]
    hiccups = iter([0.14] + [0.02] * 5)
    used = _run(gov, 6, lambda t: next(hiccups) if t == 2 else 0.05)
    assert used == [2] * 6 and gov.threads_for(1) == 2
    assert gov._sizes[1].cost[2] < 1.5 * usual


def test_disabled_or_single_core_never_touches_threads() -> None:
    torch.set_num_threads(2)
    for gov in (StepThreadGovernor(2, enabled=False), StepThreadGovernor(1)):
        used = _run(gov, 20, lambda t: 0.01 if t == 2 else 0.0)
        assert used == [2] * 20


def test_a_batch_choice_does_not_carry_over_to_the_single_stream() -> None:
    # A batch under contention switches to one thread; the contention ends, but its
    # memory-bound steps gain too little from a second thread to switch back, and its
    # probes back off. Then a single stream, clearly faster on two threads: it starts on
    # the batch's choice and switches at its own first probe. With one choice and one
    # probe schedule for every size it stayed on one thread throughout.
    torch.set_num_threads(2)
    gov = StepThreadGovernor(2)
    _run(gov, 10, lambda t: 0.05 if t == 2 else 0.01, num_tokens=32)
    batch = _run(gov, 30, lambda t: 0.020 if t == 2 else 0.022, num_tokens=32)
    assert batch[-1] == 1 and gov.threads_for(32) == 1 and gov.threads_for(1) == 1
    single = _run(gov, 20, lambda t: 0.01 if t == 2 else 0.018)
    assert single == [1] * 8 + [2] * 9 + [1] + [2] * 2  # 1 at 17: the switch confirmed
    assert gov.threads_for(1) == 2 and gov.threads_for(32) == 1


def test_a_size_not_probed_yet_follows_the_nearest_probed_one() -> None:
    # Contention: one thread wins at every size. A new size starts there, not on the
    # two threads that cost ten times as much, and its own probe confirms it.
    torch.set_num_threads(2)
    gov = StepThreadGovernor(2)
    _run(gov, 10, lambda t: 0.05 if t == 2 else 0.005, num_tokens=32)
    assert gov.threads_for(32) == 1 and gov.threads_for(4) == 1 and gov.threads_for(1000) == 1
    used = _run(gov, 12, lambda t: 0.05 if t == 2 else 0.005, num_tokens=4)
    assert used == [1] * 8 + [2] + [1] * 3 and gov.threads_for(4) == 1


def test_the_first_step_of_a_size_is_not_in_its_mean() -> None:
    # The first step pays one-time costs; in the mean it would make the first probe's
    # one-thread step (25 ms) look faster than the two-thread steps (20 ms).
    torch.set_num_threads(2)
    gov = StepThreadGovernor(2)
    times = iter([0.4] + [0.02] * 40)
    used = _run(gov, 12, lambda t: next(times) if t == 2 else 0.025)
    assert used == [2] * 8 + [1] + [2] * 3 and gov.threads_for(1) == 2


def test_the_end_of_contention_probes_at_once_on_one_thread() -> None:
    # Contention: one thread wins and the probes that confirm it back off. When it ends
    # the one-thread steps get clearly faster: two of them in a row probe two threads at
    # once, which now win, instead of waiting out the backed-off interval.
    torch.set_num_threads(2)
    gov = StepThreadGovernor(2)
    contended = _run(gov, 24, lambda t: 0.15 if t == 2 else 0.05)
    assert contended[-1] == 1 and gov._sizes[1].until_probe > tg.SPEEDUP_STEPS + 1
    quiet = _run(gov, 6, lambda t: 0.005 if t == 2 else 0.02)
    assert quiet == [1, 1, 2, 2, 2, 2] and gov.threads_for(1) == 2


def test_a_false_alarm_probes_once_until_the_next_scheduled_probe() -> None:
    # Two fast one-thread steps while two threads still cost three times as much: one
    # probe, no switch; the next fast pair probes nothing (each such probe costs a slow
    # two-thread step).
    torch.set_num_threads(2)
    gov = StepThreadGovernor(2)
    _run(gov, 24, lambda t: 0.15 if t == 2 else 0.05)
    one_thread = iter([0.02, 0.02, 0.05, 0.05, 0.02, 0.02, 0.05])
    used = _run(gov, 8, lambda t: 0.15 if t == 2 else next(one_thread))
    assert used == [1, 1, 2, 1, 1, 1, 1, 1] and gov.threads_for(1) == 1
