"""Thread settings: chosen from the usable cores, never over what the user exported."""

from __future__ import annotations

import os

import pytest

from kvserve.utils import threads


def test_choices_follow_the_affinity_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert threads.usable_cores() == 2
    assert threads.thread_settings({}) == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    assert threads.thread_settings({}) == {"OMP_NUM_THREADS": "32", "OMP_WAIT_POLICY": "ACTIVE"}


def test_user_values_win() -> None:
    user = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "active"}
    assert threads.thread_settings(user) == user


def test_child_environment_is_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with threads.child_thread_environment() as settings:
        assert os.environ["OMP_WAIT_POLICY"] == settings["OMP_WAIT_POLICY"]
        assert os.environ["OMP_NUM_THREADS"] == "1"
    assert "OMP_WAIT_POLICY" not in os.environ and os.environ["OMP_NUM_THREADS"] == "1"


def test_not_applied_once_torch_is_loaded() -> None:
    import torch  # noqa: F401  (OpenMP has read its settings by now)

    assert threads.configure_process_threads() is None
