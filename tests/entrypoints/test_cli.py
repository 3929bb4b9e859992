"""The README's promise: `kvserve generate` answers on the default model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_generate_answers_capital_of_france() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvserve.entrypoints.cli",
            "generate",
            "What is the capital of France?",
            "--max-tokens",
            "24",
            "--kv-cache-memory",
            "64M",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_bad_argument_is_a_clear_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvserve.entrypoints.cli", "generate", "hi", "--block-size", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "block_size" in result.stderr


def test_chat_reads_stdin() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvserve.entrypoints.cli",
            "chat",
            "--max-tokens",
            "24",
            "--kv-cache-memory",
            "64M",
        ],
        input="What is the capital of France?\n\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
