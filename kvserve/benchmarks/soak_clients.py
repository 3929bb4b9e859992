"""The soak's clients: the loop each one runs, the basic actions, and how outcomes are tallied.

Each client loops until the soak's deadline or request cap, drawing an action per request
from its mix (soak_features.py builds the mixes): here the basic ones, a streamed or plain
completion or chat completion (random prompt and output lengths), a stream it drops after
a few chunks (a disconnect), a request it cancels mid-flight (an abort), or a malformed
request that must be refused with a 4xx in OpenAI's error shape. An action returns its
outcome or raises SoakError, an error of a named kind; a 5xx is always one.
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvserve.benchmarks.soak_replies import SoakError, fetch_reply, status_error

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly hum old songs "
    "about rivers mountains cities and the long road home under a pale morning sky"
).split()


@functools.cache
def bad_requests(model: str) -> tuple[tuple[str, str, bytes | dict[str, Any]], ...]:
    """(name, path, body) of requests a server must refuse with a 4xx, never serve or 5xx."""
    comp = {"model": model, "prompt": "hello", "max_tokens": 4}
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    c, ch = "/v1/completions", "/v1/chat/completions"
    return (
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
    )


@dataclass
class SoakTally:
    """Everything the clients saw, merged over all of them."""

    outcomes: Counter[str] = field(default_factory=Counter)  # served, disconnected, ...
    errors: Counter[str] = field(default_factory=Counter)  # kind -> count
    error_examples: dict[str, str] = field(default_factory=dict)  # kind -> first message
    latencies_s: list[float] = field(default_factory=list)  # whole replies, end to end
    ttfts_s: list[float] = field(default_factory=list)  # whole streams
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
    prefix_words: int = 400  # the feature mix's shared system prompts


@dataclass
class Outcome:
    name: str
    timed: bool = True  # a whole reply: its latency (and a stream's TTFT) are counted
    ttft_s: float | None = None


Action = Callable[[httpx.AsyncClient, ClientPlan, random.Random], Awaitable[Outcome]]
Mix = Sequence[tuple[str, int, Action]]  # (kind, weight, action)


async def run_client(
    client: httpx.AsyncClient, plan: ClientPlan, tally: SoakTally, rng: random.Random, mix: Mix
) -> None:
    """One client's loop; ends at the deadline or once the soak's request cap is reached."""
    weights = [w for _, w, _ in mix]
    while time.monotonic() < plan.deadline and tally.started < plan.max_requests:
        tally.started += 1
        kind, _, action = rng.choices(mix, weights)[0]
        start = time.perf_counter()
        try:
            outcome = await asyncio.wait_for(
                action(client, plan, rng), timeout=plan.request_timeout_s
            )
        except SoakError as exc:
            tally.error(exc.kind, f"{kind}: {exc}")
            continue
        except TimeoutError:
            tally.error("timeout", f"{kind} took over {plan.request_timeout_s} s")
            continue
        except httpx.HTTPError as exc:
            tally.error("transport", f"{kind}: {type(exc).__name__}: {exc}")
            continue
        tally.outcomes[outcome.name] += 1
        if outcome.timed:
            tally.latencies_s.append(time.perf_counter() - start)
            if outcome.ttft_s is not None:
                tally.ttfts_s.append(outcome.ttft_s)


def random_text(rng: random.Random, max_words: int) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(1, max_words)))


def check_finish(finish_reason: str | None, allowed: tuple[str, ...] = ("stop", "length")) -> None:
    if finish_reason not in allowed:
        raise SoakError("bad_finish_reason", f"finish_reason {finish_reason!r}")


def _payload(chat: bool, plan: ClientPlan, rng: random.Random) -> tuple[str, dict[str, Any]]:
    text = random_text(rng, plan.max_prompt_words)
    body: dict[str, Any] = {"model": plan.model, "max_tokens": rng.randint(1, plan.max_tokens)}
    if chat:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}
    return "/v1/completions", {**body, "prompt": text}


async def plain(client: httpx.AsyncClient, plan: ClientPlan, rng: random.Random) -> Outcome:
    path, body = _payload(False, plan, rng)
    reply = await fetch_reply(client, path, body)
    check_finish(reply.choice().finish_reason)
    return Outcome("served")


async def stream(
    client: httpx.AsyncClient, plan: ClientPlan, rng: random.Random, chat: bool = False
) -> Outcome:
    path, body = _payload(chat, plan, rng)
    reply = await fetch_reply(client, path, {**body, "stream": True})
    check_finish(reply.choice().finish_reason)
    return Outcome("served", ttft_s=reply.ttft_s)


async def stream_chat(client: httpx.AsyncClient, plan: ClientPlan, rng: random.Random) -> Outcome:
    return await stream(client, plan, rng, chat=True)


async def disconnect(client: httpx.AsyncClient, plan: ClientPlan, rng: random.Random) -> Outcome:
    """A stream dropped after 1-4 chunks (served if it ended first)."""
    path, body = _payload(False, plan, rng)
    reply = await fetch_reply(client, path, {**body, "stream": True}, rng.randint(1, 4))
    return Outcome("disconnected", timed=False) if reply.dropped else Outcome("served", timed=False)


async def abort(client: httpx.AsyncClient, plan: ClientPlan, rng: random.Random) -> Outcome:
    """A plain request given up after a random short wait: the server sees it vanish."""
    path, body = _payload(False, plan, rng)
    try:
        response = await asyncio.wait_for(client.post(path, json=body), rng.uniform(0.01, 0.5))
    except TimeoutError:
        return Outcome("aborted", timed=False)
    if response.status_code != 200:
        raise status_error(response.status_code, response.text)
    return Outcome("served", timed=False)  # it finished before the client gave up


async def bad(client: httpx.AsyncClient, plan: ClientPlan, rng: random.Random) -> Outcome:
    name, path, body = rng.choice(bad_requests(plan.model))
    if isinstance(body, bytes):
        headers = {"content-type": "application/json"}
        response = await client.post(path, content=body, headers=headers)
    else:
        response = await client.post(path, json=body)
    status = response.status_code
    if status >= 500:
        raise SoakError("http_5xx", f"bad request {name}: {status} {response.text}")
    if status < 400:
        raise SoakError("bad_request_accepted", f"{name}: {status} {response.text}")
    if not _is_openai_error(response):
        raise SoakError("bad_error_shape", f"{name}: {status} {response.text}")
    return Outcome("rejected", timed=False)


def _is_openai_error(response: httpx.Response) -> bool:
    try:
        error = response.json().get("error")
    except ValueError:
        return False
    return isinstance(error, dict) and "message" in error


# Bad requests and drops are common enough to matter in a short run.
BASIC_MIX: Mix = (
    ("stream", 30, stream),
    ("stream_chat", 15, stream_chat),
    ("plain", 15, plain),
    ("disconnect", 15, disconnect),
    ("abort", 10, abort),
    ("bad", 15, bad),
)
