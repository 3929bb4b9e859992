"""Prometheus counters of the multimodal caches: ``<prefix>mm_processor_cache_hits`` (items
that crossed the socket as their hash), ``mm_encoder_cache_hits`` (items whose encoder
output was cached), ``mm_vision_tower_runs`` (images encoded) and the encoder cache
connector's loads and saves. The core reports running totals; the counters take deltas."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from kvserve.protocol.engine_core import MultiModalStats

_METRICS = {
    "processor_cache_queries": "Multimodal items looked up in the processor cache",
    "processor_cache_hits": "Items found there (sent as their hash alone)",
    "encoder_cache_queries": "Items a prompt chunk needed the encoder output of",
    "encoder_cache_hits": "Items whose encoder output was cached already",
    "vision_tower_runs": "Images run through the vision tower",
    "ec_connector_loads": "Encoder outputs loaded from the shared tier instead",
    "ec_connector_saves": "Encoder outputs stored to the shared tier",
}


class MultiModalProm:
    def __init__(self, registry: CollectorRegistry, prefix: str, model_name: str) -> None:
        self.model_name = model_name
        self.counters = {
            field: Counter(f"{prefix}mm_{field}", doc, ["model_name", "engine"], registry=registry)
            for field, doc in _METRICS.items()
        }
        self.collectors = list(self.counters.values())
        # Per core (engine label): the running totals it last reported.
        self._last: dict[str, MultiModalStats] = {}

    def record(self, totals: MultiModalStats, engine: str = "0") -> None:
        last = self._last.get(engine) or MultiModalStats()
        for field, counter in self.counters.items():
            delta = getattr(totals, field) - getattr(last, field)
            counter.labels(self.model_name, engine).inc(max(delta, 0))
        self._last[engine] = totals
