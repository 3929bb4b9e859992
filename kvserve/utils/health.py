"""Waiting for a kvserve server process to answer /health (launchers, benchmarks, tests)."""

from __future__ import annotations

import subprocess
import time

import httpx


def wait_until_healthy(
    url: str, proc: subprocess.Popen[bytes], deadline: float, interval_s: float = 0.3
) -> bool:
    """Polls ``url``/health until it answers 200 (True), or ``proc`` exits or the
    monotonic ``deadline`` passes (False); the caller says which and why."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    return False
