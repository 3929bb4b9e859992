"""The per-request state census: what every owner still holds, for leak hunts and tests.

Each component that keeps state per request reports its live entries by name through
`request_census()`; a process adds `per_request_objects()`, the instances of the classes
that exist once per request, counted through the garbage collector, which also finds an
object kept alive by a reference no owner knows of (a closure, a task, a cycle). Once
every request has ended, every figure in every process must be 0.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping
from typing import Protocol, TypeVar

T = TypeVar("T", bound=type)

# Census of one process: "owner.entries" -> count.
Census = dict[str, int]

_PER_REQUEST_CLASSES: dict[type, str] = {}


class CountsRequestState(Protocol):
    def request_census(self) -> Census:
        """Live per-request entries by name (all 0 once every request has ended)."""
        ...


def census_of(owners: Mapping[str, CountsRequestState]) -> Census:
    """The owners' censuses, each key prefixed with its owner's name."""
    return {
        f"{name}.{key}": count
        for name, owner in owners.items()
        for key, count in owner.request_census().items()
    }


def per_request(cls: T) -> T:
    """Class decorator: one instance exists per live request (or per child of one)."""
    _PER_REQUEST_CLASSES[cls] = f"{cls.__module__}.{cls.__qualname__}"
    return cls


def per_request_objects() -> Census:
    """Live instances of every per-request class imported in this process, unreachable
    ones collected first (a cycle the collector has not reached yet is not a leak)."""
    gc.collect()
    counts = dict.fromkeys(_PER_REQUEST_CLASSES.values(), 0)
    for obj in gc.get_objects():
        name = _PER_REQUEST_CLASSES.get(type(obj))
        if name is not None:
            counts[name] += 1
    return {f"objects.{name}": n for name, n in counts.items()}


def prefixed(prefix: str, census: Mapping[str, int]) -> Census:
    return {f"{prefix}.{key}": count for key, count in census.items()}


def leftovers(process_censuses: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    """ "process:entry" -> count for every figure that is not 0."""
    return {
        f"{process}:{key}": count
        for process, census in process_censuses.items()
        for key, count in census.items()
        if count
    }
