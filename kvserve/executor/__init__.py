"""Executors: run the workers of an engine (in-process now; multiprocess/Ray later)."""

from __future__ import annotations

from kvserve.executor.abstract import Executor
from kvserve.executor.uniproc_executor import UniProcExecutor

__all__ = ["Executor", "UniProcExecutor"]
