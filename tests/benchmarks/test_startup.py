"""`kvserve bench startup`: cold then warm starts of real processes, phase by phase."""

from __future__ import annotations

import argparse
import json
import socket
from pathlib import Path

import pytest

from kvserve.benchmarks.cli import add_bench_parser

pytestmark = pytest.mark.slow

ENGINE_ARGS = "--kv-cache-memory 32M --max-model-len 256"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_second_start_reuses_the_tokenizer_and_logs_every_phase(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    out = tmp_path / "startup.json"
    flags = ["--targets", "llm,serve", "--port", str(_free_port()), "--engine-args", ENGINE_ARGS]
    args = parser.parse_args(["bench", "startup", *flags, "--output-json", str(out)])
    assert args.func(args) == 0
    assert "serve -> healthy" in capsys.readouterr().out
    runs = {(r["target"], r["start"]): r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {(t, s) for t in ("llm", "serve") for s in ("cold", "warm")}
    assert all(run["cpu_s"] > 0 for run in runs.values())  # the work, besides the wall time

    # A second LLM() in a new process loads the cached tokenizer: nothing is converted.
    assert runs["llm", "cold"]["conversions"] == 1
    assert runs["llm", "warm"]["conversions"] == 0
    for target in ("llm", "serve"):
        cold, warm = runs[target, "cold"]["phases"], runs[target, "warm"]["phases"]
        assert "tokenizer (converted from GGUF)" in cold and "tokenizer (cached)" not in cold
        assert "tokenizer (cached)" in warm and "tokenizer (converted from GGUF)" not in warm
        for phases in (cold, warm):
            assert {"model config", "model load", "KV cache"} <= set(phases)
    # The server's engine core is its own process; its phases reach the same log.
    for start in ("cold", "warm"):
        phases = runs["serve", start]["phases"]
        expected = {"engine core interpreter", "engine core imports", "engine core process ready"}
        assert expected <= set(phases)
        assert runs["serve", start]["seconds"] > phases["engine core process ready"]
