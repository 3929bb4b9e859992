"""The soak's feature mix: requests that reach what a plain completion does not, each checked.

Beside the basic actions (soak_clients.py) the `features` mix sends: chat replies under a
`json_schema` response format (content that parses and fits the schema), forced calls of a
named tool, with now and then a tool_choice "auto" that the server's tool call parser reads
(the named function and arguments that parse and fit its parameters), n=2 with logprobs
(two choices, a logprob per token), seeded sampling (a quarter sent twice: the same text),
chats behind one of a few long fixed system prompts under three `cache_salt` tenants
(streamed half the time, some dropped mid-way), and, when the served model takes them,
small images. A wrong answer raises SoakError of a named kind, as the basic actions do.
"""

from __future__ import annotations

import base64
import functools
import io
import json
import math
import random
from typing import Any

import httpx

from kvserve.benchmarks.soak_clients import (
    BASIC_MIX,
    WORDS,
    ClientPlan,
    Mix,
    Outcome,
    abort,
    bad,
    check_finish,
    disconnect,
    plain,
    random_text,
    stream,
    stream_chat,
)
from kvserve.benchmarks.soak_replies import Choice, SoakError, fetch_reply, status_error

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MIX_NAMES = ("basic", "features")
IMAGE_MODES = ("auto", "on", "off")
SALTS = ("tenant-a", "tenant-b", "tenant-c")
# Enough for a reply that fits the small schemas below, whitespace included, to finish.
STRUCTURED_MAX_TOKENS = 64
TOP_LOGPROBS = 2

ITEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "count"],
    "additionalProperties": False,
}
TIMER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "maxLength": 16},
        "minutes": {"type": "integer", "minimum": 1, "maximum": 600},
    },
    "required": ["label", "minutes"],
    "additionalProperties": False,
}
TIMER_TOOL = {
    "type": "function",
    "function": {
        "name": "set_timer",
        "description": "Start a kitchen timer",
        "parameters": TIMER_PARAMETERS,
    },
}


@functools.cache
def shared_prefixes(words: int) -> tuple[str, ...]:
    """Three fixed system prompts of `words`, 1.25x and 1.5x `words` words, the same in every
    client and every run, so their KV is shared (per salt) across the whole soak."""
    return tuple(
        " ".join(random.Random(f"soak-prefix-{i}").choices(WORDS, k=words * (4 + i) // 4))
        for i in range(3)
    )


def schema_problem(value: Any, schema: dict[str, Any]) -> str | None:
    """What is wrong with `value` under one of the flat object schemas above (None: nothing)."""
    if not isinstance(value, dict):
        return f"not an object: {value!r}"
    properties = schema["properties"]
    missing = [k for k in schema["required"] if k not in value]
    if missing:
        return f"missing {missing} in {value!r}"
    extra = [k for k in value if k not in properties]
    if extra and schema.get("additionalProperties") is False:
        return f"unexpected {extra} in {value!r}"
    for key, spec in properties.items():
        if key not in value:
            continue
        v = value[key]
        if spec["type"] == "string":
            if not isinstance(v, str) or len(v) > spec.get("maxLength", math.inf):
                return f"{key}={v!r} is not a string of at most {spec.get('maxLength')} chars"
        elif isinstance(v, bool) or not isinstance(v, int):
            return f"{key}={v!r} is not an integer"
        elif not spec.get("minimum", -math.inf) <= v <= spec.get("maximum", math.inf):
            return f"{key}={v} is outside [{spec.get('minimum')}, {spec.get('maximum')}]"
    return None


def check_json(text: str, schema: dict[str, Any], kind: str) -> None:
    try:
        value = json.loads(text)
    except ValueError:
        raise SoakError(f"{kind}_invalid_json", f"{text!r}") from None
    problem = schema_problem(value, schema)
    if problem is not None:
        raise SoakError(f"{kind}_mismatch", problem)


async def json_schema(client: httpx.AsyncClient, plan: ClientPlan, rng: random.Random) -> Outcome:
    body = {
        "model": plan.model,
        "max_tokens": STRUCTURED_MAX_TOKENS,
        "stream": rng.random() < 0.5,
        "messages": [
            {"role": "user", "content": f"As JSON, a name and a count for: {random_text(rng, 8)}"}
        ],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "item", "schema": ITEM_SCHEMA},
        },
    }
    reply = await fetch_reply(client, CHAT, body)
    choice = reply.choice()
    check_finish(choice.finish_reason)
    if choice.finish_reason == "length":
        return Outcome("json_schema_cut", ttft_s=reply.ttft_s)
    check_json(choice.text, ITEM_SCHEMA, "json_schema")
    return Outcome("json_schema", ttft_s=reply.ttft_s)


async def tool_call(client: httpx.AsyncClient, plan: ClientPlan, rng: random.Random) -> Outcome:
    """A forced call of set_timer; a quarter are tool_choice "auto", read by the tool parser."""
    auto = rng.random() < 0.25
    named = {"type": "function", "function": {"name": "set_timer"}}
    body = {
        "model": plan.model,
        "max_tokens": STRUCTURED_MAX_TOKENS,
        "stream": rng.random() < 0.5,
        "messages": [{"role": "user", "content": f"Start a timer for {random_text(rng, 6)}"}],
        "tools": [TIMER_TOOL],
        "tool_choice": "auto" if auto else named,
    }
    reply = await fetch_reply(client, CHAT, body)
    choice = reply.choice()
    if auto:
        # The model may answer in words; a call it makes must still be a whole, valid one.
        check_finish(choice.finish_reason, ("stop", "length", "tool_calls"))
        if choice.finish_reason == "tool_calls":
            _check_call(choice)
        return Outcome("tool_call_auto", ttft_s=reply.ttft_s)
    # OpenAI ends a forced named call with "stop", not "tool_calls".
    check_finish(choice.finish_reason)
    if choice.text:
        raise SoakError("tool_call_content", f"a forced call also has content {choice.text!r}")
    if choice.finish_reason == "length":
        if choice.tool_name != "set_timer":
            raise SoakError("tool_call_wrong_name", f"{choice.tool_name!r}, cut at max_tokens")
        return Outcome("tool_call_cut", ttft_s=reply.ttft_s)
    _check_call(choice)
    return Outcome("tool_call", ttft_s=reply.ttft_s)


def _check_call(choice: Choice) -> None:
    if choice.tool_calls != 1 or choice.tool_name != "set_timer":
        raise SoakError(
            "tool_call_wrong_name", f"{choice.tool_calls} calls, the first {choice.tool_name!r}"
        )
    check_json(choice.tool_arguments, TIMER_PARAMETERS, "tool_call")


async def n2_logprobs(client: httpx.AsyncClient, plan: ClientPlan, rng: random.Random) -> Outcome:
    """n=2 with logprobs: a completion, a streamed completion or a chat completion."""
    variant = rng.randrange(3)
    max_tokens = rng.randint(1, plan.max_tokens)
    body: dict[str, Any] = {"model": plan.model, "max_tokens": max_tokens, "n": 2}
    chat = variant == 2
    if chat:
        body |= {"logprobs": True, "top_logprobs": TOP_LOGPROBS}
        body["messages"] = [{"role": "user", "content": random_text(rng, plan.max_prompt_words)}]
    else:
        body |= {"logprobs": TOP_LOGPROBS, "stream": variant == 1}
        body["prompt"] = random_text(rng, plan.max_prompt_words)
    reply = await fetch_reply(client, CHAT if chat else COMPLETIONS, body)
    if sorted(reply.choices) != [0, 1]:
        raise SoakError("n2_wrong_choices", f"choices {sorted(reply.choices)} for n=2")
    for index, choice in reply.choices.items():
        check_finish(choice.finish_reason)
        problem = _logprobs_problem(choice, max_tokens, chat)
        if problem is not None:
            kind = "logprobs_missing" if choice.logprobs is None else "logprobs_wrong"
            raise SoakError(kind, f"choice {index} ({'chat' if chat else 'completion'}): {problem}")
    return Outcome("n2_logprobs", ttft_s=reply.ttft_s)


def _logprobs_problem(choice: Choice, max_tokens: int, chat: bool) -> str | None:
    if choice.logprobs is None:
        return "no logprobs"
    positions = len(choice.logprobs)
    # Every emitted token has its logprob: all max_tokens of them when the length ran out.
    if positions > max_tokens or (choice.finish_reason == "length" and positions != max_tokens):
        return f"{positions} positions, finish {choice.finish_reason!r}, max_tokens {max_tokens}"
    for entry in choice.logprobs:
        values = [entry.logprob, *(v for _, v in entry.top)]
        if any(v is None or not v <= 1e-4 for v in values):
            return f"logprob not a number <= 0 at {entry}"
        if chat and len(entry.top) != TOP_LOGPROBS:
            return f"{len(entry.top)} top_logprobs, not {TOP_LOGPROBS}, at {entry}"
        # A completion's top_logprobs also hold the emitted token when it is not among them.
        if not chat and (
            not 1 <= len(entry.top) <= TOP_LOGPROBS + 1 or entry.token not in dict(entry.top)
        ):
            return f"top_logprobs {entry.top} for token {entry.token!r}"
    return None


async def seeded(client: httpx.AsyncClient, plan: ClientPlan, rng: random.Random) -> Outcome:
    """temperature 0.8 with a seed; a quarter are sent again and must give the same text."""
    body = {
        "model": plan.model,
        "prompt": random_text(rng, plan.max_prompt_words),
        "max_tokens": rng.randint(1, plan.max_tokens),
        "temperature": 0.8,
        "seed": rng.randrange(2**31),
    }
    first = (await fetch_reply(client, COMPLETIONS, body)).choice()
    check_finish(first.finish_reason)
    if rng.random() >= 0.25:
        return Outcome("seeded")
    again = (await fetch_reply(client, COMPLETIONS, body)).choice()
    if again.text != first.text:
        raise SoakError(
            "seed_mismatch", f"seed {body['seed']}: {first.text!r}, then {again.text!r}"
        )
    return Outcome("seeded_repeated")


async def shared_prefix(client: httpx.AsyncClient, plan: ClientPlan, rng: random.Random) -> Outcome:
    streamed = rng.random() < 0.5
    drop_after = rng.randint(1, 4) if streamed and rng.random() < 1 / 3 else None
    body = {
        "model": plan.model,
        "max_tokens": rng.randint(1, plan.max_tokens),
        "stream": streamed,
        "cache_salt": rng.choice(SALTS),
        "messages": [
            {"role": "system", "content": rng.choice(shared_prefixes(plan.prefix_words))},
            {"role": "user", "content": random_text(rng, 12)},
        ],
    }
    reply = await fetch_reply(client, CHAT, body, drop_after)
    if reply.dropped:
        return Outcome("shared_prefix_dropped", timed=False)
    check_finish(reply.choice().finish_reason)
    return Outcome("shared_prefix", ttft_s=reply.ttft_s)


def image_url(rng: random.Random) -> str:
    """A small PNG of noise as a data URL: one of eight fixed ones half the time (the
    processor cache's hits), a new one otherwise (its misses and evictions)."""
    source = random.Random(f"soak-image-{rng.randrange(8)}") if rng.random() < 0.5 else rng
    return _png_url(source.randint(16, 64), source.randint(16, 64), source.randbytes(64 * 64 * 3))


def _png_url(width: int, height: int, noise: bytes) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.frombytes("RGB", (width, height), noise[: width * height * 3]).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _image_chat(model: str, url: str, text: str, max_tokens: int) -> dict[str, Any]:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return {
        "model": model,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": parts}],
    }


async def image(client: httpx.AsyncClient, plan: ClientPlan, rng: random.Random) -> Outcome:
    body = _image_chat(
        plan.model, image_url(rng), random_text(rng, 8), rng.randint(1, plan.max_tokens)
    )
    reply = await fetch_reply(client, CHAT, {**body, "stream": rng.random() < 0.5})
    check_finish(reply.choice().finish_reason)
    return Outcome("image", ttft_s=reply.ttft_s)


async def probe_images(client: httpx.AsyncClient, model: str) -> tuple[bool, str]:
    """(whether the served model takes images, the probe's answer): one small image chat,
    since /v1/models does not say. A 4xx means no; a 5xx raises SoakError."""
    body = _image_chat(model, _png_url(16, 16, bytes(16 * 16 * 3)), "What is it?", 1)
    response = await client.post(CHAT, json=body)
    if response.status_code == 200:
        return True, "200"
    if response.status_code >= 500:
        raise status_error(response.status_code, f"image probe: {response.text}")
    return False, f"{response.status_code} {response.text[:200]}"


def build_mix(name: str, images: bool) -> Mix:
    if name not in MIX_NAMES:
        raise ValueError(f"mix must be one of {', '.join(MIX_NAMES)}, got {name!r}")
    if name == "basic":
        return BASIC_MIX
    # The basic actions keep about half the weight: the features come on top of them.
    mix: Mix = (
        ("stream", 14, stream),
        ("stream_chat", 8, stream_chat),
        ("plain", 8, plain),
        ("disconnect", 8, disconnect),
        ("abort", 6, abort),
        ("bad", 8, bad),
        ("json_schema", 9, json_schema),
        ("tool_call", 9, tool_call),
        ("n2_logprobs", 9, n2_logprobs),
        ("seeded", 7, seeded),
        ("shared_prefix", 14, shared_prefix),
    )
    return (*mix, ("image", 6, image)) if images else mix
