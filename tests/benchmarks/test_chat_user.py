"""`kvserve bench chat-user`: sequential streaming chats through real servers. The peer
here is a second `kvserve serve` started through --peer-cmd (llama.cpp's server is not
installed by `make test`), so both the peer path and kvserve's own first-token split run."""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

import pytest

from kvserve.benchmarks.chat_user import table
from kvserve.benchmarks.cli import add_bench_parser

pytestmark = pytest.mark.slow

ENGINE_ARGS = "--kv-cache-memory 32M --max-model-len 512"


def _free_port_pair() -> int:
    """A port whose successor is free too (the peer listens on port + 1)."""
    while True:
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = int(a.getsockname()[1])
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port


def test_two_servers_answer_every_chat_and_kvserve_splits_its_first_token(
    tmp_path: Path,
) -> None:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    out = tmp_path / "chat_user.json"
    peer = f"{sys.executable} -m kvserve.entrypoints.cli serve {{model}} --port {{port}} "
    peer += ENGINE_ARGS
    flags = ["--chats", "2", "--rounds", "1", "--max-tokens", "8", "--port", str(_free_port_pair())]
    flags += ["--engine-args", ENGINE_ARGS, "--peer-cmd", peer, "--result-file", str(out)]
    args = parser.parse_args(["bench", "chat-user", *flags])
    assert args.func(args) == 0
    results = json.loads(out.read_text())
    (round_,) = results["rounds"]
    assert set(round_) == {"kvserve", "peer"}
    for result in round_.values():
        assert len(result["ttft_ms"]) == 2 and all(t > 0 for t in result["ttft_ms"])
        assert len(result["decode_tok_s"]) == 2 and all(r > 0 for r in result["decode_tok_s"])
        split = result["first_token_split_ms"]  # both are kvservers: both export the metrics
        assert split["core_until_first_token"] > 0 and split["hop_to_core_and_queue"] >= 0
        # The parts add up to the client's mean first token.
        mean_ttft = sum(result["ttft_ms"]) / 2
        assert sum(split.values()) == pytest.approx(mean_ttft)
    assert "| 1 | peer |" in table(results)
