"""The router's prefix source in controller mode: a `kvserve cache-controller`'s /lookup.

The controller knows every registered instance's tiers (its device cache and its CPU,
disk and remote KV tier); an instance's cached prefix is the longest any of its tiers
holds, since the tiered connector loads what the device cache lacks. A controller that
does not answer leaves the choice to load alone (logged): routing goes on without it.
"""

from __future__ import annotations

import logging

import httpx

logger = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 5.0


class ControllerLookup:
    def __init__(self, url: str, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.headers = {} if api_key is None else {"authorization": f"Bearer {api_key}"}

    async def match(
        self, client: httpx.AsyncClient, token_ids: list[int], cache_salt: str | None
    ) -> dict[str, int]:
        """Cached prefix tokens per instance URL, the best of each instance's tiers."""
        try:
            answer = await client.post(
                f"{self.url}/lookup",
                json={"tokens": token_ids, "cache_salt": cache_salt},
                headers=self.headers,
                timeout=LOOKUP_TIMEOUT_S,
            )
            answer.raise_for_status()
            found: dict[str, dict[str, int]] = answer.json()["instances"]
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            logger.warning("cache controller lookup failed (%r): routing by load", exc)
            return {}
        return {url: max(tiers.values(), default=0) for url, tiers in found.items()}
