"""The grammar backend interface (ABC + registry) every structured-output library plugs into.

A backend turns a StructuredOutputsParams into a compiled grammar once (cached by spec in
the manager) and hands out a fresh matcher per request. Bitmasks are int32 rows of
ceil(vocab_size / 32) words, bit ``t`` of the row set when token ``t`` is allowed (the
layout xgrammar and llguidance share).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from kvserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch


class StructuredOutputGrammar(ABC):
    """One request's matcher: where in the grammar its output is."""

    @abstractmethod
    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advances over ``tokens``; False (and no advance past it) at the first one the
        grammar does not allow."""

    @abstractmethod
    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest prefix of ``tokens`` the grammar allows, without advancing."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Forgets the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, idx: int) -> None:
        """Writes the allowed next tokens into row ``idx`` of ``bitmask``."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the grammar is complete (its stop token accepted): the output is done."""

    @abstractmethod
    def reset(self) -> None: ...


class StructuredOutputBackend(ABC):
    """A grammar library bound to one tokenizer and vocabulary.

    ``compile`` may be slow and runs on the manager's compile threads; ``validate`` is
    cheap and runs in the front end, so bad specs fail before reaching the engine core.
    """

    name: ClassVar[str]

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    @classmethod
    @abstractmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        """Raises ValueError, naming the problem, for a spec this backend cannot run."""

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar: an immutable object many matchers can share."""

    @abstractmethod
    def new_grammar(self, compiled: Any) -> StructuredOutputGrammar:
        """A fresh matcher at the start of ``compiled``."""


_BACKENDS: dict[str, type[StructuredOutputBackend]] = {}
# Resolved by the registry itself rather than one library.
AUTO = "auto"
# Known without importing them (each brings its grammar library along).
BUILTIN_BACKENDS = ("guidance", "xgrammar")


def register_backend(
    name: str,
) -> Callable[[type[StructuredOutputBackend]], type[StructuredOutputBackend]]:
    """Class decorator: makes a backend selectable as ``--structured-outputs-backend name``."""

    def wrap(cls: type[StructuredOutputBackend]) -> type[StructuredOutputBackend]:
        cls.name = name
        _BACKENDS[name] = cls
        return cls

    return wrap


def get_backend_class(name: str) -> type[StructuredOutputBackend]:
    _import_builtin_backends()
    if name not in _BACKENDS:
        raise ValueError(
            f"structured outputs backend {name!r} is unknown; known: "
            f"{', '.join([AUTO, *sorted(_BACKENDS)])}"
        )
    return _BACKENDS[name]


def backend_names() -> list[str]:
    """Every selectable name; cheap (imports no grammar library)."""
    return [AUTO, *sorted({*BUILTIN_BACKENDS, *_BACKENDS})]


def resolve_backend(name: str, params: StructuredOutputsParams) -> str:
    """The backend to run ``params`` on, checking the spec (ValueError when invalid).

    ``auto`` is vLLM's rule: xgrammar, unless it cannot run the spec and llguidance can.
    """
    if name != AUTO:
        get_backend_class(name).validate(params)
        return name
    try:
        get_backend_class("xgrammar").validate(params)
        return "xgrammar"
    except ValueError as xgrammar_error:
        try:
            get_backend_class("guidance").validate(params)
        except ValueError:
            raise xgrammar_error from None
        return "guidance"


def _import_builtin_backends() -> None:
    from kvserve.structured_output import backend_guidance, backend_xgrammar  # noqa: F401
