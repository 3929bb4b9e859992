"""xgrammar: compiled grammars with a precomputed token cache; the default backend."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import xgrammar as xgr

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured_output.backend_types import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
    register_backend,
)
from kvserve.structured_output.utils import choice_as_ebnf, legacy_structural_tag

if TYPE_CHECKING:
    import torch


class XgrammarGrammar(StructuredOutputGrammar):
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.matcher = matcher
        self.num_processed_tokens = 0

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        for token in tokens:
            if not self.matcher.accept_token(token):
                return False
            self.num_processed_tokens += 1
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        accepted: list[int] = []
        for token in tokens:
            if not self.matcher.accept_token(token):
                break
            accepted.append(token)
        if accepted:
            self.matcher.rollback(len(accepted))
        return accepted

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self.num_processed_tokens -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, idx: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, idx)

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def reset(self) -> None:
        self.matcher.reset()
        self.num_processed_tokens = 0


@register_backend("xgrammar")
class XgrammarBackend(StructuredOutputBackend):
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        super().__init__(tokenizer, vocab_size)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # The manager runs compiles on its own threads; one thread each inside xgrammar.
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    @classmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        try:
            _grammar(params)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(_message(params, exc)) from None

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        return self.compiler.compile_grammar(_grammar(params))

    def new_grammar(self, compiled: Any) -> StructuredOutputGrammar:
        return XgrammarGrammar(xgr.GrammarMatcher(compiled))


def _grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """Parses the spec (no tokenizer needed): raises on an invalid one."""
    kind, spec = params.kind, params.spec
    if kind == "json":
        if params.whitespace_pattern is not None:
            raise ValueError("xgrammar does not support whitespace_pattern")
        schema = json.loads(spec)
        if params.disable_additional_properties:
            schema = _no_additional_properties(schema)
        grammar = xgr.Grammar.from_json_schema(
            json.dumps(schema), any_whitespace=not params.disable_any_whitespace
        )
        return _without_raw_control_characters(grammar)
    if kind == "json_object":
        return xgr.Grammar.builtin_json_grammar()
    if kind == "regex":
        return xgr.Grammar.from_regex(spec)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_as_ebnf(params.choice or []))
    if kind == "grammar":
        if "start:" in spec or "%import" in spec:
            raise ValueError("xgrammar takes EBNF (root ::= ...), not Lark grammars")
        return xgr.Grammar.from_ebnf(spec)
    tag = json.loads(spec)
    legacy = legacy_structural_tag(tag)
    if legacy is not None:
        structures, triggers = legacy
        items = [
            xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
            for s in structures
        ]
        return xgr.Grammar.from_structural_tag(items, triggers)
    return xgr.Grammar.from_structural_tag(tag)


# xgrammar 0.2.9 writes the characters of a string with minLength/maxLength as this class,
# which lets raw control characters through (invalid JSON: a soak against a random model
# produced them); its unbounded strings exclude them, as the fix below does.
_BOUNDED_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"


def _without_raw_control_characters(grammar: xgr.Grammar) -> xgr.Grammar:
    ebnf = str(grammar)
    if _BOUNDED_STRING_CHAR not in ebnf:
        return grammar
    return xgr.Grammar.from_ebnf(ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))


def _no_additional_properties(schema: Any) -> Any:
    """The schema with additionalProperties false on every object that does not set it."""
    if isinstance(schema, dict):
        out = {k: _no_additional_properties(v) for k, v in schema.items()}
        if out.get("type") == "object" and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_no_additional_properties(v) for v in schema]
    return schema


# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: ".
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _message(params: StructuredOutputsParams, exc: Exception) -> str:
    reason = _LOG_PREFIX.sub("", str(exc).strip())
    return f"structured_outputs.{params.kind} is invalid: {reason}"
