"""The cache controller's HTTP bodies (pydantic: FastAPI validates them and publishes
them in the OpenAPI schema at /openapi.json)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, Field, model_validator

# A ZMQ endpoint the controller connects to: tcp://HOST:PORT ([v6 address] too) or ipc://PATH.
_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):\d{1,5}|ipc://\S+")
# The tiers the controller acts on (lookups report "device" too: the engine's own cache,
# whose scheduler decides what stays there).
StoreTier = Literal["cpu", "disk", "remote"]


class RegisterRequest(BaseModel):
    url: str = Field(description="the instance's OpenAI API base, e.g. http://127.0.0.1:8001")
    control: str = Field(description="its KV tier control endpoint (control_endpoint)")
    tier_events: str | None = Field(None, description="its tier events (tier_events_endpoint)")
    kv_events: str | None = Field(
        None, description="its engine's KV events (--kv-events-config endpoint): device tier"
    )
    block_size: int = Field(16, gt=0, description="the engine's --block-size")
    prefix_caching_hash_seed: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> RegisterRequest:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError("url must start with http:// or https://")
        for name in ("control", "tier_events", "kv_events"):
            value = getattr(self, name)
            if value is not None and not _ENDPOINT.fullmatch(value):
                raise ValueError(f"{name} must be a ZMQ endpoint tcp://HOST:PORT or ipc://PATH")
        return self


class DeregisterRequest(BaseModel):
    url: str = Field(description="the URL the instance registered with")


class Prompt(BaseModel):
    """A prompt given as token ids or as text (tokenized by a registered instance)."""

    tokens: list[int] | None = None
    text: str | None = None
    cache_salt: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> Prompt:
        if (self.tokens is None) == (self.text is None):
            raise ValueError("give exactly one of tokens and text")
        return self


class LookupResponse(BaseModel):
    num_tokens: int
    # instance -> tier -> prefix tokens held there (tiers holding none are left out)
    instances: dict[str, dict[str, int]]


class PinRequest(Prompt):
    instance: str
    tier: StoreTier = "cpu"


class PinResponse(BaseModel):
    instance: str
    tier: str
    num_tokens: int = Field(
        description="prefix tokens pinned (unpinned): up to the first chunk missing"
    )


class ClearRequest(BaseModel):
    instance: str
    tier: StoreTier


class MoveRequest(Prompt):
    source: str
    source_tier: StoreTier = "cpu"
    target: str
    target_tier: StoreTier = "cpu"


class MoveResponse(BaseModel):
    num_tokens: int = Field(description="prefix tokens the target's tier now holds from the move")
    num_chunks: int
    rejected: int = Field(description="chunks the target refused (MAC, model or shard mismatch)")


class InstanceInfo(BaseModel):
    name: str
    url: str
    control: str
    model: str
    block_size: int
    chunk_size: int
    tiers: list[str]
    held: dict[str, int] = Field(description="tier -> hashes (device blocks, tier chunks) held")


class HealthResponse(BaseModel):
    healthy: bool
    instances: dict[str, bool]
