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


_RELEASE_SCRIPT = """
import os, threading, time, torch
from kvserve.utils import threads

def tasks():
    return len(os.listdir("/proc/self/task"))

def run():
    torch.set_num_threads(2)
    torch.full((1 << 22,), 1.0)  # above torch's grain size: a parallel region
    before = tasks()
    released = threads.release_openmp_team()
    deadline = time.monotonic() + 5.0  # the worker thread exits on its own time
    while tasks() >= before and time.monotonic() < deadline:
        time.sleep(0.01)
    print(released, before, tasks())

thread = threading.Thread(target=run)
thread.start()
thread.join()
"""


def test_release_openmp_team_ends_the_threads_team() -> None:
    """On a thread of its own, in a fresh process: the test process's other threads
    (servers, pools of earlier tests) come and go and would blur the count."""
    import subprocess
    import sys

    if not os.path.isdir("/proc/self/task"):
        pytest.skip("threads are counted in Linux's /proc")
    done = subprocess.run(
        [sys.executable, "-c", _RELEASE_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    released, before, after = done.stdout.split()
    if released != "True":
        pytest.skip("torch runs on another OpenMP runtime than libgomp here")
    assert int(after) == int(before) - 1  # the team's one worker thread ended
