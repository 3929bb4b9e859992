"""Speculative decoding metrics: vLLM's Prometheus counters and its periodic log line.

The scheduler reports running totals (SpecDecodingStats); both consumers take deltas, so a
stats message that is missed loses nothing.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter

from kvserve.protocol.engine_core import SpecDecodingStats

logger = logging.getLogger(__name__)


def _delta(now: SpecDecodingStats, last: SpecDecodingStats | None) -> SpecDecodingStats:
    if last is None:
        return now
    per_pos = [
        a - b
        for a, b in zip(
            now.num_accepted_tokens_per_pos, last.num_accepted_tokens_per_pos, strict=False
        )
    ]
    return SpecDecodingStats(
        num_spec_tokens=now.num_spec_tokens,
        num_drafts=now.num_drafts - last.num_drafts,
        num_draft_tokens=now.num_draft_tokens - last.num_draft_tokens,
        num_accepted_tokens=now.num_accepted_tokens - last.num_accepted_tokens,
        num_accepted_tokens_per_pos=per_pos,
    )


class SpecDecodingProm:
    """``<prefix>spec_decode_num_drafts`` and friends, vLLM's names and position label."""

    def __init__(self, registry: CollectorRegistry, prefix: str, model_name: str) -> None:
        labels = ["model_name", "engine"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(prefix + name, doc, labels + list(extra), registry=registry)

        self.model_name = model_name
        self.num_drafts = counter(
            "spec_decode_num_drafts", "Verified drafts (one per request and step)"
        )
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified")
        self.num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted"
        )
        self.num_accepted_tokens_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at this position was accepted",
            ("position",),
        )
        self.collectors = [
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            self.num_accepted_tokens_per_pos,
        ]
        # Per core (engine label): the running totals it last reported.
        self._last: dict[str, SpecDecodingStats] = {}

    def record(self, totals: SpecDecodingStats, engine: str = "0") -> None:
        delta = _delta(totals, self._last.get(engine))
        self._last[engine] = totals
        name = self.model_name
        self.num_drafts.labels(name, engine).inc(max(delta.num_drafts, 0))
        self.num_draft_tokens.labels(name, engine).inc(max(delta.num_draft_tokens, 0))
        self.num_accepted_tokens.labels(name, engine).inc(max(delta.num_accepted_tokens, 0))
        for pos, count in enumerate(delta.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos.labels(name, engine, str(pos)).inc(max(count, 0))


class SpecDecodingLogging:
    """vLLM's "SpecDecoding metrics" line: acceptance since the previous line."""

    def __init__(self) -> None:
        self._last_logged: SpecDecodingStats | None = None
        self._latest: SpecDecodingStats | None = None

    def observe(self, totals: SpecDecodingStats) -> None:
        self._latest = totals

    def format_line(self, elapsed: float) -> str | None:
        """The line for the interval since the last call, or None when nothing was drafted."""
        if self._latest is None:
            return None
        delta = _delta(self._latest, self._last_logged)
        self._last_logged = self._latest
        if delta.num_drafts <= 0:
            return None
        per_pos = ", ".join(
            f"{count / delta.num_drafts:.3f}" for count in delta.num_accepted_tokens_per_pos
        )
        elapsed = max(elapsed, 1e-9)
        return (
            f"SpecDecoding metrics: Mean acceptance length: {delta.mean_acceptance_length:.2f}, "
            f"Accepted throughput: {delta.num_accepted_tokens / elapsed:.2f} tokens/s, "
            f"Drafted throughput: {delta.num_draft_tokens / elapsed:.2f} tokens/s, "
            f"Accepted: {delta.num_accepted_tokens} tokens, "
            f"Drafted: {delta.num_draft_tokens} tokens, "
            f"Per-position acceptance rate: {per_pos}, "
            f"Avg Draft acceptance rate: {delta.draft_acceptance_rate * 100:.1f}%"
        )
