"""The soak's view of a reply: a JSON body or an SSE stream, assembled into one form per choice.

Completions and chat completions, whole or streamed, come back as a `Reply` whose choices
carry the text, the finish reason, the first tool call and the logprobs, so each client
action checks one shape. Whatever an operator would count as a failure of the server (a
non-200 status, an error event, a stream that ends without [DONE], a body that is not the
OpenAI shape) raises `SoakError` with the kind it is counted under.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


class SoakError(Exception):
    """A wrong answer, counted under `kind` (with the message as its example)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


@dataclass
class Logprob:
    """One position's logprobs: the emitted token, its logprob and the alternatives."""

    token: str
    logprob: float | None
    top: list[tuple[str, float]]


@dataclass
class Choice:
    text: str = ""  # completion text or chat content
    finish_reason: str | None = None
    tool_name: str | None = None  # the first tool call's
    tool_arguments: str = ""
    tool_calls: int = 0
    logprobs: list[Logprob] | None = None  # None: the reply had none for this choice


@dataclass
class Reply:
    choices: dict[int, Choice] = field(default_factory=dict)
    ttft_s: float | None = None  # streams: until the first event
    dropped: bool = False  # the client closed the stream before [DONE]

    def choice(self, index: int = 0) -> Choice:
        if index not in self.choices:
            raise SoakError("malformed_reply", f"no choice {index} among {sorted(self.choices)}")
        return self.choices[index]


def status_error(status: int, text: str) -> SoakError:
    kind = "http_5xx" if status >= 500 else "http_4xx_on_good"
    return SoakError(kind, f"{status} {text}")


async def fetch_reply(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], drop_after: int | None = None
) -> Reply:
    """Posts `body` (an SSE stream when body["stream"]); `drop_after` events closes it early."""
    if not body.get("stream"):
        response = await client.post(path, json=body)
        if response.status_code != 200:
            raise status_error(response.status_code, response.text)
        reply = Reply()
        for raw in _field(response.json(), "choices", list):
            _merge(reply.choices, raw)
        return reply
    reply = Reply()
    start = time.perf_counter()
    events, done = 0, False
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            raise status_error(response.status_code, (await response.aread()).decode())
        async for line in response.aiter_lines():
            data = line.removeprefix("data:").strip()
            if not line.startswith("data:") or not data:
                continue
            if data == "[DONE]":
                done = True
                break
            event = _loads(data)
            if "error" in event:
                raise SoakError("stream_error", data)
            if reply.ttft_s is None:
                reply.ttft_s = time.perf_counter() - start
            for raw in _field(event, "choices", list):
                _merge(reply.choices, raw)
            events += 1
            if drop_after is not None and events >= drop_after:
                # Closing the response here is the disconnect the server must absorb.
                reply.dropped = True
                return reply
    if not done:
        raise SoakError("incomplete_stream", f"{events} events and no [DONE]")
    return reply


def _loads(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        raise SoakError("malformed_reply", f"not JSON: {text[:200]}") from None
    if not isinstance(value, dict):
        raise SoakError("malformed_reply", f"not an object: {text[:200]}")
    return value


def _field(obj: Any, name: str, kind: type) -> Any:
    value = obj.get(name) if isinstance(obj, dict) else None
    if not isinstance(value, kind):
        raise SoakError("malformed_reply", f"{name} is {value!r}, not a {kind.__name__}")
    return value


def _merge(choices: dict[int, Choice], raw: Any) -> None:
    """Adds one choice of a body, or one chunk's delta of a stream, to `choices`."""
    try:
        _merge_fields(choices, raw)
    except (KeyError, TypeError, AttributeError) as exc:
        raise SoakError("malformed_reply", f"{type(exc).__name__} {exc} in {raw!r}"[:300]) from None


def _merge_fields(choices: dict[int, Choice], raw: Any) -> None:
    index = _field(raw, "index", int)
    choice = choices.setdefault(index, Choice())
    message = raw.get("message") or raw.get("delta")
    if message is None:  # a completion
        choice.text += _field(raw, "text", str)
    else:
        choice.text += message.get("content") or ""
        for position, call in enumerate(message.get("tool_calls") or []):
            function = call.get("function") or {}
            # A whole call, or a stream's first delta of one, carries the call's id.
            choice.tool_calls += "id" in call
            # Only the first call is assembled: the soak forces a single named function.
            if call.get("index", position) == 0:
                choice.tool_name = function.get("name") or choice.tool_name
                choice.tool_arguments += function.get("arguments") or ""
    if raw.get("finish_reason") is not None:
        choice.finish_reason = raw["finish_reason"]
    logprobs = raw.get("logprobs")
    if logprobs is not None:
        choice.logprobs = (choice.logprobs or []) + _logprobs(logprobs)


def _logprobs(raw: Any) -> list[Logprob]:
    if not isinstance(raw, dict):
        raise SoakError("malformed_reply", f"logprobs is {raw!r}")
    if "content" in raw:  # chat: a list of {token, logprob, top_logprobs: [...]}
        return [
            Logprob(
                token=entry["token"],
                logprob=entry["logprob"],
                top=[(t["token"], t["logprob"]) for t in entry.get("top_logprobs") or []],
            )
            for entry in raw["content"] or []
        ]
    tokens, values, tops = raw.get("tokens"), raw.get("token_logprobs"), raw.get("top_logprobs")
    if not (isinstance(tokens, list) and isinstance(values, list) and isinstance(tops, list)):
        raise SoakError("malformed_reply", f"completion logprobs {raw!r}"[:300])
    if not len(tokens) == len(values) == len(tops):
        raise SoakError(
            "logprobs_wrong",
            f"{len(tokens)} tokens, {len(values)} logprobs, {len(tops)} top_logprobs",
        )
    return [
        Logprob(token=t, logprob=v, top=list((top or {}).items()))
        for t, v, top in zip(tokens, values, tops, strict=True)
    ]
