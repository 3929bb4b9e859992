"""Per-step state that attention layers read without threading it through every call.

The model runner wraps each forward in ``set_forward_context(attn_metadata)``; the
``Attention`` layers deep inside the model call ``get_forward_context()``. This keeps
model signatures to ``forward(input_ids, positions)`` as in HF-style code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


class TokenSelector:
    """Which tokens the layers after ``check_layer`` compute (CacheBlend, see
    worker/blend_selection.py). This no-op form keeps every token: ``check_layer`` is -1,
    so a model's layer loop never calls ``select`` and ``restore`` hands states back."""

    check_layer: int = -1

    def select(self, hidden_states: Any, residual: Any, positions: Any) -> tuple[Any, Any, Any]:
        """After layer ``check_layer``: the rows the remaining layers compute."""
        return hidden_states, residual, positions

    def restore(self, hidden_states: Any) -> Any:
        """After the last layer: the rows back at their places in the step's batch."""
        return hidden_states


NO_TOKEN_SELECTOR = TokenSelector()


class UBatchContext:
    """Where a collective inside the forward lets another micro-batch run (dual batch
    overlap, worker/ubatching.py). This no-op form, outside micro-batches, runs the
    collective to completion in place."""

    def overlap(self, start: Callable[[bool], Any]) -> None:
        """``start(async_op)`` issues the collective; with ``async_op`` it returns the
        work handle, which the micro-batch waits on after the other one's turn."""
        start(False)


NO_UBATCH = UBatchContext()


@dataclass
class ForwardContext:
    # Backend-specific metadata built once per step (e.g. CPUAttentionMetadata).
    attn_metadata: Any
    # Worker-side KV connector; attention layers will call its per-layer
    # load/save hooks once the KV-transfer path exists.
    kv_connector: Any = None
    # Set by the model runner's blend component for a step that reuses blended KV.
    token_selector: TokenSelector = NO_TOKEN_SELECTOR
    # The micro-batch this forward is (dual batch overlap); the no-op one for a whole step.
    ubatch: UBatchContext = NO_UBATCH
    # Room for later per-step values (e.g. virtual engine, dp metadata).
    extra: dict[str, Any] = field(default_factory=dict)


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(
    attn_metadata: Any, kv_connector: Any = None, **extra: Any
) -> Iterator[ForwardContext]:
    """Install a context for the duration of one model forward; nests safely."""
    global _current
    previous = _current
    _current = ForwardContext(attn_metadata=attn_metadata, kv_connector=kv_connector, extra=extra)
    try:
        yield _current
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError(
            "no forward context is set: run the model inside "
            "`with set_forward_context(attn_metadata): ...`"
        )
    return _current


def override_forward_context(context: ForwardContext | None) -> ForwardContext | None:
    """Installs ``context`` and returns the one it replaces. Micro-batch threads take
    turns at the forward: each installs its own context when its turn comes."""
    global _current
    previous, _current = _current, context
    return previous


def current_ubatch() -> UBatchContext:
    """The running micro-batch; the no-op one outside micro-batches."""
    return NO_UBATCH if _current is None else _current.ubatch


def current_token_selector() -> TokenSelector:
    """The step's token selector; the no-op one outside a forward context."""
    return NO_TOKEN_SELECTOR if _current is None else _current.token_selector


def is_forward_context_set() -> bool:
    return _current is not None
