"""vLLM's metrics reader: a snapshot of the Prometheus metrics as plain objects, for
offline use (``LLM.get_metrics()``), each with a ``name`` and a value."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

# Counters labelled by position are read as one Vector (vLLM's per-position acceptance).
_VECTOR_LABEL = "position"


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Vector(Metric):
    """A counter per position: values[i] is position i's count."""

    values: list[int] = field(default_factory=list)


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    # Upper bound ("+Inf" included) -> cumulative count.
    buckets: dict[str, int] = field(default_factory=dict)


def get_metrics_snapshot(registry: CollectorRegistry) -> list[Metric]:
    metrics: list[Metric] = []
    for family in registry.collect():
        if family.type == "counter":
            metrics += _counters(family.name, family.samples)
        elif family.type == "gauge":
            metrics += [Gauge(family.name, dict(s.labels), float(s.value)) for s in family.samples]
        elif family.type == "histogram":
            metrics += _histograms(family.name, family.samples)
    return metrics


def _counters(name: str, samples: list) -> list[Metric]:  # type: ignore[type-arg]
    totals = [s for s in samples if s.name.endswith("_total")]
    if not any(_VECTOR_LABEL in s.labels for s in totals):
        return [Counter(name, dict(s.labels), int(s.value)) for s in totals]
    vectors: dict[tuple[tuple[str, str], ...], dict[int, int]] = {}
    for s in totals:
        labels = {k: v for k, v in s.labels.items() if k != _VECTOR_LABEL}
        key = tuple(sorted(labels.items()))
        vectors.setdefault(key, {})[int(s.labels[_VECTOR_LABEL])] = int(s.value)
    result: list[Metric] = []
    for key, by_pos in vectors.items():
        values = [by_pos.get(i, 0) for i in range(max(by_pos) + 1)]
        result.append(Vector(name, dict(key), values))
    return result


def _histograms(name: str, samples: list) -> list[Metric]:  # type: ignore[type-arg]
    by_labels: dict[tuple[tuple[str, str], ...], Histogram] = {}
    for s in samples:
        labels = {k: v for k, v in s.labels.items() if k != "le"}
        key = tuple(sorted(labels.items()))
        hist = by_labels.setdefault(key, Histogram(name, labels, 0, 0.0))
        if s.name.endswith("_bucket"):
            hist.buckets[s.labels["le"]] = int(s.value)
        elif s.name.endswith("_count"):
            hist.count = int(s.value)
        elif s.name.endswith("_sum"):
            hist.sum = float(s.value)
    return list(by_labels.values())
