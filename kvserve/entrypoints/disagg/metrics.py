"""The proxy's own /metrics: latency per stage, requests per instance, KV bytes moved."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        # prefill: the prefiller's whole answer (max_tokens=1); decode_first_byte: from
        # sending to the decoder until its first byte; request: the client's whole request.
        self.stage_seconds = Histogram(
            "kvserve_proxy_stage_seconds", "Seconds per stage of a request", ["stage"],
            buckets=_BUCKETS, registry=reg,
        )  # fmt: skip
        self.requests = Counter(
            "kvserve_proxy_requests", "Requests sent to each instance", ["stage", "instance"],
            registry=reg,
        )  # fmt: skip
        self.errors = Counter(
            "kvserve_proxy_errors", "Requests that failed, by the stage they failed in",
            ["stage"], registry=reg,
        )  # fmt: skip
        self.aborts = Counter(
            "kvserve_proxy_client_aborts", "Streams the client left before their end",
            registry=reg,
        )  # fmt: skip
        self.kv_bytes = Counter(
            "kvserve_proxy_kv_transfer_bytes",
            "KV bytes the prefillers reported sent to the decoders", registry=reg,
        )  # fmt: skip
        self.kv_tokens = Counter(
            "kvserve_proxy_kv_transfer_tokens", "Prompt tokens whose KV was sent", registry=reg
        )
        for stage in ("prefill", "decode_first_byte", "request"):
            self.stage_seconds.labels(stage)
        for stage in ("prefill", "decode"):
            self.errors.labels(stage)

    def text(self) -> bytes:
        return generate_latest(self.registry)
