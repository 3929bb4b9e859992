"""Thread settings: chosen from the usable cores, never over what the user exported."""

from __future__ import annotations

import os

import pytest

from kvserve.utils import threads


def test_choices_follow_the_affinity_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert threads.usable_cores() == 2
    # A bounded spin, not PASSIVE: workers sleeping at every barrier made decode ~1.4x slower.
    assert threads.thread_settings({}) == {"OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": "100000"}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    assert threads.thread_settings({}) == {"OMP_NUM_THREADS": "32", "OMP_WAIT_POLICY": "ACTIVE"}


def test_user_values_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    user = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "active"}
    assert threads.thread_settings(user) == user  # no spin count over the user's policy
    user = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": "7"}
    assert threads.thread_settings(user) == {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive"}
    assert threads.thread_settings({"GOMP_SPINCOUNT": "7"})["GOMP_SPINCOUNT"] == "7"


def test_child_environment_is_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with threads.child_thread_environment() as settings:
        assert os.environ["GOMP_SPINCOUNT"] == settings["GOMP_SPINCOUNT"]
        assert os.environ["OMP_NUM_THREADS"] == "1"
    assert "GOMP_SPINCOUNT" not in os.environ and os.environ["OMP_NUM_THREADS"] == "1"


def test_not_applied_once_torch_is_loaded() -> None:
    import torch  # noqa: F401  (OpenMP has read its settings by now)

    assert threads.configure_process_threads() is None


def test_release_openmp_team_ends_the_threads_team() -> None:
    # On a thread of its own: the test process's main thread keeps whatever team it has.
    import threading

    import torch

    if not os.path.isdir("/proc/self/task"):
        pytest.skip("threads are counted in Linux's /proc")

    def tasks() -> int:
        return len(os.listdir("/proc/self/task"))

    counts: list[int] = []
    released: list[bool] = []

    def run() -> None:
        torch.set_num_threads(2)
        torch.full((1 << 22,), 1.0)  # above torch's grain size: a parallel region
        counts.append(tasks())
        released.append(threads.release_openmp_team())
        counts.append(tasks())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if not released[0]:
        pytest.skip("torch runs on another OpenMP runtime than libgomp here")
    assert counts[1] == counts[0] - 1  # the team's one worker thread ended
