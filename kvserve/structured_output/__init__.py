"""Structured outputs: grammar-constrained decoding on xgrammar or llguidance.

The front end validates a request's spec and picks its backend (``resolve_backend``); the
engine core's StructuredOutputManager compiles it asynchronously and fills a per-step token
bitmask; the worker masks the logits with it before sampling (``apply_grammar_bitmask``).
"""

from kvserve.structured_output.backend_types import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
    backend_names,
    get_backend_class,
    register_backend,
    resolve_backend,
)
from kvserve.structured_output.manager import StructuredOutputManager
from kvserve.structured_output.request import StructuredOutputRequest

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
