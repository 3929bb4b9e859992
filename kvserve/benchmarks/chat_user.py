"""`kvserve bench chat-user`: one person chatting, through `kvserve serve` and a peer server.

The most common use of a CPU engine: one user, one conversation at a time. Each server
(kvserve, and an OpenAI-compatible peer started from ``--peer-cmd``: llama.cpp's
``llama-server`` or llama-cpp-python's ``llama_cpp.server`` on the same GGUF) answers the
same sequential streaming chats, greedy, in alternating rounds. Reported per server: time
to first token (client side) and decode tok/s after it. For kvserve, the first token is
split from its own /metrics: the front end's HTTP + chat-template share (client TTFT
minus the server's arrival-to-first-token), the hop to the core and its wait (queue
time), and the core's steps until the token (scheduler, inputs, forward, sampling).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvserve.benchmarks.serve import stream_request

CHATS = (
    "What is the capital of France?",
    "Give me three tips for a good night's sleep.",
    "Explain what a hash table is in two sentences.",
    "Write a haiku about autumn leaves.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Suggest a name for a small coffee shop.",
    "What does HTTP stand for?",
)
DEFAULT_PEER_CMD = (
    f"{sys.executable} -m llama_cpp.server --model {{model}} --port {{port}} "
    "--n_threads 2 --n_ctx 4096 --chat_format chatml"
)
# Summed histograms of the server's /metrics that split a first token.
_TTFT = "time_to_first_token_seconds"
_QUEUE = "request_queue_time_seconds"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model (default: the packaged SmolLM2)")
    parser.add_argument("--chats", type=int, default=8, help="sequential chats per round")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--engine-args", default="", help="extra `kvserve serve` flags")
    parser.add_argument(
        "--peer-cmd",
        default=DEFAULT_PEER_CMD,
        help="the peer server's command; {model} is the GGUF path, {port} its port "
        "(e.g. 'llama-server -m {model} --port {port} -t 2'); '' for kvserve only",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to become healthy")
    parser.add_argument("--result-file", default=None, help="write the results as JSON here")


class _Server:
    """A server process and its base URL; stopped on exit."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path) -> None:
        self.name, self.url, self.log = name, f"http://127.0.0.1:{port}", log
        self._out = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); log: {self.log}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not healthy in {timeout} s; log: {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()


def _histogram_sums(text: str) -> dict[str, float]:
    """``{name_sum: value, name_count: value}`` of the TTFT and queue histograms, summed
    over labels (kvserve: prefix)."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removeprefix("kvserve:")
            if name.startswith((_TTFT, _QUEUE, "step_time_seconds_total")) and not name.endswith(
                "_bucket"
            ):
                key = name + (f":{sample.labels['phase']}" if "phase" in sample.labels else "")
                sums[key] = sums.get(key, 0.0) + sample.value
    return sums


async def _chat_round(server: _Server, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    """The chats one after another; per chat its client TTFT and decode rate, and for a
    kvserve server the mean split of the first token from its metrics."""
    ttfts: list[float] = []
    rates: list[float] = []
    split: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=args.timeout) as client:
        models = (await client.get(server.url + "/v1/models")).json()["data"]
        model = models[0]["id"]
        for i in range(args.chats):
            before = await _metrics(client, server.url)
            # The tag opens the message: no round re-sends a prompt a server has cached
            # (the chat template's fixed prefix still is, as in real use).
            content = f"({tag}.{i}) {CHATS[i % len(CHATS)]}"
            messages = [{"role": "user", "content": content}]
            payload = {
                "model": model,
                "messages": messages,
                "max_tokens": args.max_tokens,
                "temperature": 0.0,
            }
            out = await stream_request(
                client, server.url + "/v1/chat/completions", payload, chat=True, prompt_len=0
            )
            if not out.success:
                raise RuntimeError(f"{server.name}: {out.error}")
            after = await _metrics(client, server.url)
            ttfts.append(out.ttft)
            decode_s = sum(out.itl)
            # A server that sends no usage in its stream (llama_cpp.server): one token a chunk.
            tokens = out.output_tokens or len(out.itl) + 1
            if tokens > 1 and decode_s > 0:
                rates.append((tokens - 1) / decode_s)
            if before is not None and after is not None:
                for key, value in after.items():
                    split[key] = split.get(key, 0.0) + value - before.get(key, 0.0)
    result: dict[str, Any] = {
        "ttft_ms": [1000 * t for t in ttfts],
        "decode_tok_s": rates,
    }
    count = split.get(_TTFT + "_count", 0.0)
    if count:
        server_ttft = split[_TTFT + "_sum"] / count
        queue = split.get(_QUEUE + "_sum", 0.0) / max(split.get(_QUEUE + "_count", 0.0), 1.0)
        result["first_token_split_ms"] = {
            "http_and_chat_template": 1000 * (statistics.fmean(ttfts) - server_ttft),
            "hop_to_core_and_queue": 1000 * queue,
            "core_until_first_token": 1000 * (server_ttft - queue),
        }
    return result


async def _metrics(client: httpx.AsyncClient, url: str) -> dict[str, float] | None:
    try:
        response = await client.get(url + "/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    if response.status_code != 200 or "time_to_first_token" not in response.text:
        return None
    return _histogram_sums(response.text)


def _servers(args: argparse.Namespace, log_dir: Path) -> list[_Server]:
    from kvserve.transformers_utils.model_resolver import resolve_model

    resolved = resolve_model(args.model)
    kvserve_cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", resolved.path]
    kvserve_cmd += ["--port", str(args.port), *shlex.split(args.engine_args)]
    servers = [_Server("kvserve", kvserve_cmd, args.port, log_dir / "kvserve.log")]
    if args.peer_cmd:
        if resolved.format != "gguf":
            raise ValueError("--peer-cmd: the peer needs a GGUF model")
        cmd = args.peer_cmd.format(model=resolved.path, port=args.port + 1)
        servers.append(_Server("peer", shlex.split(cmd), args.port + 1, log_dir / "peer.log"))
    return servers


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    log_dir = Path(tempfile.mkdtemp(prefix="kvserve-chat-user-"))
    servers = _servers(args, log_dir)
    results: dict[str, Any] = {"chats": args.chats, "max_tokens": args.max_tokens, "rounds": []}
    try:
        for server in servers:
            server.wait_healthy(args.timeout)
        for server in servers:  # a first chat each, so no round pays a first-request cost
            asyncio.run(
                _chat_round(server, argparse.Namespace(**{**vars(args), "chats": 1}), "warm-up")
            )
        for index in range(args.rounds):
            results["rounds"].append(
                {s.name: asyncio.run(_chat_round(s, args, str(index))) for s in servers}
            )
    finally:
        for server in servers:
            server.stop()
    return results


def table(results: dict[str, Any]) -> str:
    lines = [
        "| round | server | TTFT p50 (ms) | TTFT range | decode tok/s p50 | first token split (ms) |"
    ]
    lines.append("|---|---|---:|---|---:|---|")
    for index, round_ in enumerate(results["rounds"], 1):
        for name, r in round_.items():
            ttft = r["ttft_ms"]
            split = r.get("first_token_split_ms")
            split_text = (
                ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in split.items())
                if split
                else ""
            )
            rate = statistics.median(r["decode_tok_s"]) if r["decode_tok_s"] else float("nan")
            lines.append(
                f"| {index} | {name} | {statistics.median(ttft):.1f} | "
                f"{min(ttft):.1f}-{max(ttft):.1f} | {rate:.1f} | {split_text} |"
            )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    import json

    results = run(args)
    print(table(results))
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(results, indent=2))
    return 0
