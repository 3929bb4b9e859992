"""The soak's clients: what one client does per request, and how each outcome is classed.

Each client loops until the soak's deadline or request cap, drawing an action per
request: a streamed or plain completion or chat completion (random prompt and output
lengths), a stream it drops after a few chunks (a disconnect), a request it cancels
mid-flight (an abort), or a malformed request that must be refused with a 4xx in
OpenAI's error shape. Anything else is an error of a named kind; a 5xx is always one.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly hum old songs "
    "about rivers mountains cities and the long road home under a pale morning sky"
).split()

# (kind, weight). Bad requests and drops are common enough to matter in a short run.
ACTIONS = (
    ("stream", 30),
    ("stream_chat", 15),
    ("plain", 15),
    ("disconnect", 15),
    ("abort", 10),
    ("bad", 15),
)


def bad_requests(model: str) -> list[tuple[str, str, bytes | dict[str, Any]]]:
    """(name, path, body) of requests a server must refuse with a 4xx, never serve or 5xx."""
    comp = {"model": model, "prompt": "hello", "max_tokens": 4}
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    c, ch = "/v1/completions", "/v1/chat/completions"
    return [
        ("invalid_json", c, b'{"model": "x", "prompt": '),
        ("missing_prompt", c, {"model": model, "max_tokens": 4}),
        ("negative_max_tokens", c, {**comp, "max_tokens": -1}),
        ("string_temperature", c, {**comp, "temperature": "hot"}),
        ("top_p_above_one", c, {**comp, "top_p": 5}),
        ("n_zero", c, {**comp, "n": 0}),
        ("unknown_model", c, {**comp, "model": "no-such-model"}),
        ("prompt_beyond_context", c, {**comp, "prompt": [100] * 20000}),
        ("token_id_beyond_vocab", c, {**comp, "prompt": [10**9]}),
        ("empty_prompt_ids", c, {**comp, "prompt": []}),
        ("stop_wrong_type", c, {**comp, "stop": 12}),
        ("huge_logprobs", c, {**comp, "logprobs": 1000}),
        ("messages_not_a_list", ch, {**chat, "messages": "hi"}),
        # (A role the template does not know is accepted, as vLLM accepts custom roles.)
        ("message_not_an_object", ch, {**chat, "messages": ["hi"]}),
        ("string_seed", ch, {**chat, "seed": "x"}),
    ]


@dataclass
class SoakTally:
    """Everything the clients saw, merged over all of them."""

    outcomes: Counter[str] = field(default_factory=Counter)  # served, disconnected, ...
    errors: Counter[str] = field(default_factory=Counter)  # kind -> count
    error_examples: dict[str, str] = field(default_factory=dict)  # kind -> first message
    latencies_s: list[float] = field(default_factory=list)  # served requests, end to end
    ttfts_s: list[float] = field(default_factory=list)  # served streams
    started: int = 0

    def error(self, kind: str, detail: str) -> None:
        self.errors[kind] += 1
        self.error_examples.setdefault(kind, detail[:300])


@dataclass
class ClientPlan:
    model: str
    deadline: float  # time.monotonic()
    max_requests: int
    max_tokens: int
    max_prompt_words: int
    request_timeout_s: float


async def run_client(
    client: httpx.AsyncClient, plan: ClientPlan, tally: SoakTally, rng: random.Random
) -> None:
    """One client's loop; ends at the deadline or once the soak's request cap is reached."""
    kinds = [k for k, _ in ACTIONS]
    weights = [w for _, w in ACTIONS]
    bad = bad_requests(plan.model)
    while time.monotonic() < plan.deadline and tally.started < plan.max_requests:
        tally.started += 1
        kind = rng.choices(kinds, weights)[0]
        try:
            if kind == "bad":
                await _bad(client, rng.choice(bad), tally)
            elif kind == "abort":
                await _abort(client, plan, tally, rng)
            else:
                await asyncio.wait_for(
                    _good(client, kind, plan, tally, rng), timeout=plan.request_timeout_s
                )
        except TimeoutError:
            tally.error("timeout", f"{kind} took over {plan.request_timeout_s} s")
        except httpx.HTTPError as exc:
            tally.error("transport", f"{kind}: {type(exc).__name__}: {exc}")


def _payload(kind: str, plan: ClientPlan, rng: random.Random) -> tuple[str, dict[str, Any]]:
    text = " ".join(rng.choices(WORDS, k=rng.randint(1, plan.max_prompt_words)))
    body: dict[str, Any] = {"model": plan.model, "max_tokens": rng.randint(1, plan.max_tokens)}
    if kind == "stream_chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}
    return "/v1/completions", {**body, "prompt": text}


async def _good(
    client: httpx.AsyncClient, kind: str, plan: ClientPlan, tally: SoakTally, rng: random.Random
) -> None:
    path, body = _payload(kind, plan, rng)
    start = time.perf_counter()
    if kind == "plain":
        response = await client.post(path, json=body)
        if _status_error(response.status_code, kind, response.text, tally):
            return
        choice = response.json()["choices"][0]
        if choice.get("finish_reason") not in ("stop", "length"):
            tally.error("bad_finish_reason", f"{kind}: {choice.get('finish_reason')!r}")
            return
        tally.latencies_s.append(time.perf_counter() - start)
        tally.outcomes["served"] += 1
        return
    # A stream; "disconnect" drops it after a few chunks.
    drop_after = rng.randint(1, 4) if kind == "disconnect" else None
    body = {**body, "stream": True}
    chunks, first, done = 0, None, False
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            _status_error(response.status_code, kind, (await response.aread()).decode(), tally)
            return
        async for line in response.aiter_lines():
            data = line.removeprefix("data:").strip()
            if not line.startswith("data:") or not data:
                continue
            if data == "[DONE]":
                done = True
                break
            if "error" in json.loads(data):
                tally.error("stream_error", f"{kind}: {data}")
                return
            chunks += 1
            first = first if first is not None else time.perf_counter() - start
            if drop_after is not None and chunks >= drop_after:
                break  # closing the response here is the disconnect the server must absorb
    if drop_after is not None:
        tally.outcomes["disconnected" if not done else "served"] += 1
    elif not done:
        tally.error("incomplete_stream", f"{kind}: {chunks} chunks and no [DONE]")
    else:
        tally.latencies_s.append(time.perf_counter() - start)
        tally.ttfts_s.append(first if first is not None else 0.0)
        tally.outcomes["served"] += 1


async def _abort(
    client: httpx.AsyncClient, plan: ClientPlan, tally: SoakTally, rng: random.Random
) -> None:
    """A plain request given up after a random short wait: the server sees it vanish."""
    path, body = _payload("plain", plan, rng)
    try:
        response = await asyncio.wait_for(client.post(path, json=body), rng.uniform(0.01, 0.5))
    except TimeoutError:
        tally.outcomes["aborted"] += 1
        return
    if not _status_error(response.status_code, "abort", response.text, tally):
        tally.outcomes["served"] += 1  # it finished before the client gave up


async def _bad(
    client: httpx.AsyncClient, case: tuple[str, str, bytes | dict[str, Any]], tally: SoakTally
) -> None:
    name, path, body = case
    if isinstance(body, bytes):
        headers = {"content-type": "application/json"}
        response = await client.post(path, content=body, headers=headers)
    else:
        response = await client.post(path, json=body)
    status = response.status_code
    if status >= 500:
        tally.error("http_5xx", f"bad request {name}: {status} {response.text}")
    elif status < 400:
        tally.error("bad_request_accepted", f"{name}: {status} {response.text}")
    elif not _is_openai_error(response):
        tally.error("bad_error_shape", f"{name}: {status} {response.text}")
    else:
        tally.outcomes["rejected"] += 1


def _is_openai_error(response: httpx.Response) -> bool:
    try:
        error = response.json().get("error")
    except ValueError:
        return False
    return isinstance(error, dict) and "message" in error


def _status_error(status: int, kind: str, text: str, tally: SoakTally) -> bool:
    if status == 200:
        return False
    tally.error("http_5xx" if status >= 500 else "http_4xx_on_good", f"{kind}: {status} {text}")
    return True
