"""Executor test fixtures: the tiny TP checkpoints, built once per session."""

from __future__ import annotations

from typing import Any

import pytest

from tests.executor.tiny_llama import make_checkpoints


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return make_checkpoints(tmp_path_factory.mktemp("tp_tiny_llama"))
