"""Tenants: several API keys, each naming whose requests it authenticates, and KV that is
never shared between them.

A shared prefix cache is a side channel: a request that hits runs its prefill faster, so
one client can learn whether another already sent a prompt (prompt-cache timing attacks
have been shown on public APIs). `cache_salt` closes it only for clients that set it.
With ``--api-key-file`` every request carries its tenant's salt, combined with the
client's own (never replaced by it), so no KV block, tier chunk or router index entry of
one tenant can serve another; requests of one tenant still share their prefixes.

The middleware that checks the key sets the request's tenant (a context variable, read
where the request enters the engine); a server with one key or none has no tenants and
salts nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import AsyncGenerator, Mapping

from prometheus_client import Counter

from kvserve.outputs import RequestOutput
from kvserve.utils.secret_file import read_secret_file

# The tenant of the request being handled (None: no tenants configured).
current_tenant: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kvserve_tenant", default=None
)


class TenantCounters:
    """/metrics per tenant, registered only by a server that has tenants."""

    def __init__(self, prefix: str) -> None:
        self.requests = Counter(
            f"{prefix}:tenant_requests", "Generation requests per tenant", ["tenant"]
        )
        self.prompt_tokens = Counter(
            f"{prefix}:tenant_prompt_tokens", "Prompt tokens per tenant", ["tenant"]
        )
        self.cached_tokens = Counter(
            f"{prefix}:tenant_cached_prompt_tokens",
            "Prompt tokens per tenant found in the prefix cache or the KV tier",
            ["tenant"],
        )


_counters: TenantCounters | None = None


def enable_tenant_metrics(prefix: str) -> None:
    """Registers the per-tenant series (once per process: one Prometheus registry)."""
    global _counters
    if _counters is None:
        _counters = TenantCounters(prefix)


def load_api_keys(path: str) -> dict[str, str]:
    """``key tenant`` per line (``#`` comments, blank lines allowed) -> {key: tenant}."""
    read_secret_file(path, "--api-key-file")  # its mode and that it is not empty
    keys: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) != 2:
                raise ValueError(f"--api-key-file {path}:{number}: expected 'KEY TENANT'")
            key, tenant = fields
            if key in keys:
                raise ValueError(f"--api-key-file {path}:{number}: a key is listed twice")
            keys[key] = tenant
    if not keys:
        raise ValueError(f"--api-key-file {path} lists no keys")
    return keys


def bearer_keys(api_key: str | None, key_file: str | None) -> Mapping[bytes, str | None]:
    """The accepted ``Authorization`` header values -> their tenant (None for --api-key's)."""
    accepted: dict[bytes, str | None] = {}
    if api_key:
        accepted[f"Bearer {api_key}".encode()] = None
    if key_file:
        for key, tenant in load_api_keys(key_file).items():
            accepted[f"Bearer {key}".encode()] = tenant
    return accepted


def tenant_salt(tenant: str | None, client_salt: str | None) -> str | None:
    """The salt a request's KV is hashed with: its tenant's, then the client's own (the
    router computes the same, so that its prefix index matches the instances' blocks)."""
    if tenant is None:
        return client_salt
    return f"tenant:{tenant}" if client_salt is None else f"tenant:{tenant}|{client_salt}"


def tenant_cache_salt(client_salt: str | None) -> str | None:
    """The salt of the request being handled (its tenant from the API key it sent)."""
    return tenant_salt(current_tenant.get(), client_salt)


async def counted(
    outputs: AsyncGenerator[RequestOutput, None], tenant: str
) -> AsyncGenerator[RequestOutput, None]:
    """``outputs``, counting the request's prompt and cached tokens for ``tenant``; closing
    it closes ``outputs`` (which aborts the request in the engine)."""
    assert _counters is not None, "tenants without enable_tenant_metrics()"
    counters = _counters
    counters.requests.labels(tenant).inc()
    first = True
    async with contextlib.aclosing(outputs):
        async for output in outputs:
            if first:
                first = False
                counters.prompt_tokens.labels(tenant).inc(len(output.prompt_token_ids or ()))
                counters.cached_tokens.labels(tenant).inc(output.num_cached_tokens or 0)
            yield output
