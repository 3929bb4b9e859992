"""`kvserve bench serve`: a load generator for any OpenAI-compatible server.

Streams completions (or chat completions) over httpx, with Poisson arrivals and a cap on
concurrency, and reports request/token throughput and TTFT, TPOT, ITL and end-to-end
latency (mean, median, p99). It talks only to the base URL it is given (loopback by
default) and is bounded both in request count and in time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx
import numpy as np
from tqdm.auto import tqdm

from kvserve.benchmarks.datasets import (
    Conversation,
    SampleRequest,
    sample_multi_turn_conversations,
    sample_random_requests,
    sample_shared_prefix_requests,
)
from kvserve.benchmarks.metrics import calculate_metrics, print_metrics
from kvserve.benchmarks.step_times import (
    print_step_time_breakdown,
    scrape_step_times,
    step_time_breakdown,
)


@dataclass
class RequestFuncOutput:
    """What one streamed request measured (seconds)."""

    success: bool = False
    generated_text: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""


async def stream_request(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], chat: bool, prompt_len: int
) -> RequestFuncOutput:
    """Sends one streaming request and times every SSE chunk that carries text."""
    out = RequestFuncOutput(prompt_len=prompt_len)
    payload = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                out.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return out
            async for line in response.aiter_lines():
                data = line.removeprefix("data:").strip()
                if not line.startswith("data:") or not data:
                    continue
                if data == "[DONE]":
                    break
                body = json.loads(data)
                if "error" in body:
                    out.error = str(body["error"].get("message", body["error"]))
                    return out
                now = time.perf_counter()
                for choice in body.get("choices") or []:
                    text = (
                        (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    )
                    if not text:
                        continue
                    if not out.generated_text:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                    out.generated_text += text
                if body.get("usage"):
                    out.output_tokens = body["usage"]["completion_tokens"]
                    out.prompt_len = body["usage"]["prompt_tokens"]
        out.latency = time.perf_counter() - start
        out.success = True
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def _arrivals(
    count: int, request_rate: float, burstiness: float, seed: int
) -> AsyncIterator[int]:
    """Yields 0..count-1, spaced by gamma-distributed gaps (Poisson when burstiness=1)."""
    rng = np.random.default_rng(seed)
    for i in range(count):
        yield i
        if request_rate != float("inf") and i < count - 1:
            await asyncio.sleep(rng.gamma(burstiness, 1.0 / (request_rate * burstiness)))


async def run_benchmark(
    args: argparse.Namespace, model: str, requests: list[SampleRequest] | list[Conversation]
) -> dict[str, Any]:
    chat = args.backend == "openai-chat"
    url = args.base_url.rstrip("/") + args.endpoint
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # A conversation is one task but as many requests as it has turns.
    total = sum(len(r.user_turns) if isinstance(r, Conversation) else 1 for r in requests)
    semaphore = asyncio.Semaphore(args.max_concurrency or len(requests) or 1)
    outputs: list[RequestFuncOutput] = []
    bar = tqdm(total=total, desc="requests", disable=args.disable_tqdm)
    limits = httpx.Limits(
        max_connections=args.max_concurrency or None, max_keepalive_connections=64
    )

    def payload(prompt: str | list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": max_tokens,
            "temperature": args.temperature,
            "ignore_eos": args.ignore_eos,
        }
        body["messages" if chat else "prompt"] = prompt
        if args.json_schema is not None:
            body["structured_outputs"] = {"json": args.json_schema}
        return body

    async def one(client: httpx.AsyncClient, request: SampleRequest | Conversation) -> None:
        async with semaphore:
            if isinstance(request, Conversation):
                messages: list[dict[str, str]] = []
                for turn in request.user_turns:
                    messages.append({"role": "user", "content": turn})
                    result = await stream_request(
                        client, url, payload(list(messages), request.expected_output_len), True, 0
                    )
                    outputs.append(result)
                    bar.update(1)
                    if not result.success:
                        return
                    messages.append({"role": "assistant", "content": result.generated_text})
                return
            prompt: Any = [{"role": "user", "content": request.prompt}] if chat else request.prompt
            outputs.append(
                await stream_request(
                    client,
                    url,
                    payload(prompt, request.expected_output_len),
                    chat,
                    request.prompt_len,
                )
            )
            bar.update(1)

    timeout = httpx.Timeout(args.request_timeout, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, headers=headers, limits=limits) as client:
        # The server's step-time totals bracket the timed region (kvserve servers only).
        before = await scrape_step_times(client, args.base_url)
        start = time.perf_counter()
        tasks: list[asyncio.Task[None]] = []

        async def launch() -> None:
            async for i in _arrivals(len(requests), args.request_rate, args.burstiness, args.seed):
                tasks.append(asyncio.create_task(one(client, requests[i])))
            await asyncio.gather(*tasks)

        try:
            await asyncio.wait_for(launch(), timeout=args.max_duration)
        except TimeoutError:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            print(f"bench serve: stopped after --max-duration={args.max_duration}s")
        duration = time.perf_counter() - start
        after = await scrape_step_times(client, args.base_url)
    bar.close()
    # Requests cut off by the time limit count as failed.
    outputs.extend(
        RequestFuncOutput(error="not finished within --max-duration")
        for _ in range(total - len(outputs))
    )
    metrics = calculate_metrics(outputs, duration)
    metrics["step_time_breakdown"] = step_time_breakdown(before, after, duration)
    return metrics


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--backend", default="openai", choices=["openai", "openai-chat"])
    parser.add_argument(
        "--endpoint", default=None, help="default /v1/completions (openai) or /v1/chat/completions"
    )
    # Its own dest: `kvserve`'s main fills a missing args.model with the default model.
    parser.add_argument(
        "--model",
        dest="bench_model",
        metavar="MODEL",
        default=None,
        help="model name (default: the server's)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer for the datasets (default: --model, else the default)",
    )
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--dataset-name", default="random", choices=["random", "shared-prefix", "multi-turn"]
    )
    parser.add_argument(
        "--num-prompts", type=int, default=100, help="requests (conversations for multi-turn)"
    )
    parser.add_argument("--random-input-len", type=int, default=128)
    parser.add_argument("--random-output-len", type=int, default=64)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: tokens")
    parser.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: groups")
    parser.add_argument("--num-turns", type=int, default=3, help="multi-turn: user turns")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals (inf: all at once)",
    )
    parser.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps (1 = Poisson)",
    )
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly the requested output length",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument(
        "--max-duration", type=float, default=1800.0, help="stop the run after this many seconds"
    )
    parser.add_argument(
        "--json-schema",
        type=_json_schema,
        default=None,
        help="constrain every request's output to this JSON schema (a file or the JSON "
        "text), sent as vLLM's structured_outputs: measures the grammar's overhead",
    )
    parser.add_argument("--result-file", default=None, help="write the results as JSON here")
    parser.add_argument("--disable-tqdm", action="store_true")


def _json_schema(value: str) -> dict[str, Any]:
    text = value
    if not value.lstrip().startswith("{"):
        with open(value, encoding="utf-8") as f:
            text = f.read()
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--json-schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise argparse.ArgumentTypeError("--json-schema must be a JSON object")
    return schema


def _load_tokenizer(name: str | None) -> Any:
    from kvserve.transformers_utils.model_resolver import resolve_model
    from kvserve.transformers_utils.tokenizer import get_tokenizer

    try:
        return get_tokenizer(resolve_model(name))
    except (ValueError, OSError):
        # A served name that is not a local model: fall back to the default tokenizer.
        return get_tokenizer(resolve_model(None))


def _dataset(args: argparse.Namespace, tokenizer: Any) -> list[SampleRequest] | list[Conversation]:
    if args.dataset_name == "multi-turn":
        return sample_multi_turn_conversations(
            tokenizer,
            args.num_prompts,
            args.num_turns,
            args.random_input_len,
            args.random_output_len,
            args.seed,
        )
    if args.dataset_name == "shared-prefix":
        return sample_shared_prefix_requests(
            tokenizer,
            args.num_prompts,
            args.prefix_len,
            args.random_input_len,
            args.random_output_len,
            args.num_prefixes,
            args.seed,
        )
    return sample_random_requests(
        tokenizer,
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        args.seed,
    )


def main(args: argparse.Namespace) -> int:
    if args.dataset_name == "multi-turn":
        args.backend = "openai-chat"  # turns only make sense as a chat
    args.base_url = args.base_url or f"http://{args.host}:{args.port}"
    args.endpoint = args.endpoint or (
        "/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions"
    )
    model = args.bench_model
    if model is None:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        response = httpx.get(
            args.base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30.0
        )
        response.raise_for_status()
        model = response.json()["data"][0]["id"]
    requests = _dataset(args, _load_tokenizer(args.tokenizer or model))
    metrics = asyncio.run(run_benchmark(args, model, requests))
    print_metrics(metrics)
    print_step_time_breakdown(metrics["step_time_breakdown"])
    if args.result_file:
        result = {
            "date": datetime.now().isoformat(timespec="seconds"),
            "backend": args.backend,
            "base_url": args.base_url,
            "model": model,
            "dataset_name": args.dataset_name,
            "num_prompts": args.num_prompts,
            "request_rate": str(args.request_rate),
            "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency,
            "json_schema": args.json_schema,
            **metrics,
        }
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        print(f"results written to {args.result_file}")
    return 0 if metrics["completed"] > 0 else 1
