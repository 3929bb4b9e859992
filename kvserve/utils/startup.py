"""Start-up phase timing, logged at INFO in one greppable shape.

Every phase logs ``startup phase <name>: <seconds> s`` (plus ``key=value`` details) from
the ``kvserve.startup`` logger, in whichever process runs it; ``kvserve bench startup``
reads these lines back from the processes it starts.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Iterator

logger = logging.getLogger("kvserve.startup")

PHASE_LINE = re.compile(r"startup phase (?P<name>.+?): (?P<seconds>\d+\.\d+) s")


@contextlib.contextmanager
def startup_phase(name: str, **details: object) -> Iterator[None]:
    """Times the block and logs it as one start-up phase (also when it raises)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        log_phase(name, time.perf_counter() - start, **details)


def log_phase(name: str, seconds: float, **details: object) -> None:
    extra = "".join(f" {key}={value}" for key, value in details.items())
    logger.info("startup phase %s: %.3f s%s", name, seconds, extra)


def parse_phases(log_text: str) -> dict[str, float]:
    """``{phase name: seconds}`` from a log; a phase logged twice keeps its sum."""
    phases: dict[str, float] = {}
    for match in PHASE_LINE.finditer(log_text):
        name = match["name"]
        phases[name] = phases.get(name, 0.0) + float(match["seconds"])
    return phases
