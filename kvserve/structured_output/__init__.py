"""Structured outputs: grammar-constrained decoding on xgrammar or llguidance.

The front end validates a request's spec and picks its backend (``resolve_backend``); the
engine core's StructuredOutputManager compiles it asynchronously and fills a per-step token
bitmask; the worker masks the logits with it before sampling (``apply_grammar_bitmask``).
"""

from typing import TYPE_CHECKING, Any

from kvserve.structured_output.backend_types import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
    backend_names,
    get_backend_class,
    register_backend,
    resolve_backend,
)
from kvserve.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    from kvserve.structured_output.manager import StructuredOutputManager


def __getattr__(name: str) -> Any:
    # The manager (torch) loads in the engine core only: core/request.py imports this
    # package in the serve front end, which must start the core before torch loads.
    if name == "StructuredOutputManager":
        from kvserve.structured_output.manager import StructuredOutputManager

        return StructuredOutputManager
    raise AttributeError(name)


__all__ = [
    "StructuredOutputBackend",
    "StructuredOutputGrammar",
    "StructuredOutputManager",
    "StructuredOutputRequest",
    "backend_names",
    "get_backend_class",
    "register_backend",
    "resolve_backend",
]
