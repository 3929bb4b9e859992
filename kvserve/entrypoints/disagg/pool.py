"""The prefill and decode instances behind the disaggregation proxy, and how one is picked."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Instance:
    """One `kvserve serve`: ``url`` serves the OpenAI API; a consumer running
    P2pZmqConnector also names where producers send its KV (``kv_host``:``kv_port``)."""

    url: str
    kv_host: str | None = None
    kv_port: int | None = None
    in_flight: int = 0
    served: int = 0

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
    """Least requests in flight first, then least served (so a quiet pool alternates)."""

    def __init__(self, instances: list[Instance], flag: str) -> None:
        if not instances:
            raise ValueError(f"the proxy needs at least one {flag}")
        urls = [i.url for i in instances]
        if len(set(urls)) != len(urls):
            raise ValueError(f"{flag}: an instance is named twice")
        self.instances = instances

    def pick(self) -> Instance:
        return min(self.instances, key=lambda i: (i.in_flight, i.served))
