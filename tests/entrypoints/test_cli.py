"""The README's promise: `kvserve generate` answers on the default model."""

from __future__ import annotations

import argparse
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


# The serve front end (parser, engine config, web stack): all of it but the engine core.
_FRONT_END = """
import sys
from kvserve.entrypoints.cli import _command, build_parser
argv = ["serve", "SmolLM2-135M-Instruct"]
args = build_parser(_command(argv)).parse_args(argv)
import kvserve.entrypoints.openai.api_server
from kvserve.args.engine_args import EngineArgs
from kvserve.engine.async_llm import AsyncLLM
config = EngineArgs.from_cli_args(args).create_engine_config()
print(config.device_config.device, "torch" in sys.modules)
"""


def test_serve_front_end_spawns_the_core_before_importing_torch() -> None:
    """torch costs the front end seconds; only the engine core needs it."""
    result = subprocess.run(
        [sys.executable, "-c", _FRONT_END],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    device, torch_imported = result.stdout.split()
    assert torch_imported == "False"
    import torch

    assert device == ("cuda" if torch.cuda.is_available() else "cpu")


def test_a_command_registers_in_full_and_still_lists_the_others() -> None:
    from kvserve.entrypoints.cli import build_parser

    full = build_parser()
    for command in ("serve", "cache-server", "bench", "events"):
        lazy = build_parser(command)
        assert lazy.format_help() == full.format_help()  # `kvserve --help` lists them all
        assert _sub_help(lazy, command) == _sub_help(full, command)
    # The others are bare entries: the cache server's flags are not there for `serve`.
    assert "--max-memory" in _sub_help(full, "cache-server")
    assert "--max-memory" not in _sub_help(build_parser("serve"), "cache-server")


def _sub_help(parser: argparse.ArgumentParser, command: str) -> str:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return str(action.choices[command].format_help())


def test_api_server_module_is_the_serve_command() -> None:
    """vLLM's `python -m ...api_server` runs `kvserve serve` (its thread settings, its core
    spawned early): the same parser, the same flags."""

    def help_text(*args: str) -> str:
        result = subprocess.run(
            [sys.executable, "-m", *args, "--help"], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    module = help_text("kvserve.entrypoints.openai.api_server")
    assert module == help_text("kvserve.entrypoints.cli", "serve")
    assert "--max-model-len" in module
