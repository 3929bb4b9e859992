"""The prefill and decode instances behind the disaggregation proxy, and how one is picked."""

from __future__ import annotations

import time
from dataclasses import dataclass

# An instance that refused a connection goes to the back of the line for this long.
COOLDOWN_S = 5.0


@dataclass
class Instance:
    """One `kvserve serve`: ``url`` serves the OpenAI API; a consumer running
    P2pZmqConnector also names where producers send its KV (``kv_host``:``kv_port``)."""

    url: str
    kv_host: str | None = None
    kv_port: int | None = None
    in_flight: int = 0
    served: int = 0
    failed_at: float = -COOLDOWN_S  # time.monotonic() of its last connection failure

    def cooling_down(self) -> bool:
        return time.monotonic() - self.failed_at < COOLDOWN_S

    @classmethod
    def parse(cls, spec: str, flag: str) -> Instance:
        """``URL`` or ``URL=KV_HOST:KV_PORT``."""
        url, sep, kv = spec.partition("=")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{flag} {spec!r}: expected URL[=KV_HOST:KV_PORT]")
        if not sep:
            return cls(url.rstrip("/"))
        host, _, port = kv.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{flag} {spec!r}: KV address must be HOST:PORT, got {kv!r}")
        return cls(url.rstrip("/"), host, int(port))


class Pool:
    """Least requests in flight first, then least served (so a quiet pool alternates);
    instances that just failed a connection last."""

    def __init__(self, instances: list[Instance], flag: str) -> None:
        if not instances:
            raise ValueError(f"the proxy needs at least one {flag}")
        urls = [i.url for i in instances]
        if len(set(urls)) != len(urls):
            raise ValueError(f"{flag}: an instance is named twice")
        self.instances = instances

    def pick(self) -> Instance:
        return self.by_preference()[0]

    def by_preference(self) -> list[Instance]:
        """All instances, the preferred one first."""
        return sorted(self.instances, key=lambda i: (i.cooling_down(), i.in_flight, i.served))
