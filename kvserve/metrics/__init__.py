"""Engine statistics: per-iteration stats and the loggers that publish them."""

from __future__ import annotations

from kvserve.metrics.history import StatsHistory
from kvserve.metrics.loggers import LoggingStatLogger, PrometheusStatLogger, StatLoggerBase
from kvserve.metrics.stats import (
    FinishedRequestStats,
    IterationStats,
    RequestStateStats,
    RequestStatsTracker,
)

__all__ = [
    "FinishedRequestStats",
    "IterationStats",
    "LoggingStatLogger",
    "PrometheusStatLogger",
    "RequestStateStats",
    "RequestStatsTracker",
    "StatLoggerBase",
    "StatsHistory",
]
