"""llguidance (`guidance`): Earley-parsed grammars computed lazily per token, no compile
cache to build; takes Lark grammars and regexes xgrammar does not."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured_output.backend_types import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
    register_backend,
)
from kvserve.structured_output.utils import choice_as_lark, legacy_structural_tag

if TYPE_CHECKING:
    import torch


class GuidanceGrammar(StructuredOutputGrammar):
    """llguidance stops as soon as nothing but the end can follow; the mask then allows
    only EOS, and the grammar counts as terminated once EOS is taken (as with xgrammar),
    so a request always ends on its stop token."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_id: int) -> None:
        self.matcher = matcher
        self.eos_token_id = eos_token_id
        self.terminated = False

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        for token in tokens:
            if self.terminated:
                return False
            if self.matcher.is_stopped():
                if token != self.eos_token_id:
                    return False
                self.terminated = True
                continue
            if not self.matcher.consume_token(token) or self.matcher.is_error():
                return False
            if token == self.eos_token_id:
                self.terminated = True
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        return tokens[: self.matcher.validate_tokens(tokens)]

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self.terminated = False

    def fill_bitmask(self, bitmask: torch.Tensor, idx: int) -> None:
        # Here, not at the top: the front end validates grammars with this module and
        # loads no torch (llguidance.torch does); the core, which fills masks, has it.
        import llguidance.torch

        # A stopped matcher fills [EOS] alone.
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, idx)

    def is_terminated(self) -> bool:
        return self.terminated

    def reset(self) -> None:
        self.matcher.reset()
        self.terminated = False


@register_backend("guidance")
class GuidanceBackend(StructuredOutputBackend):
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        super().__init__(tokenizer, vocab_size)
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, vocab_size)

    @classmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        try:
            grammar = serialize_guidance_grammar(params)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"structured_outputs.{params.kind} is invalid: {exc}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error:
            raise ValueError(f"structured_outputs.{params.kind} is invalid: {error}")

    def compile(self, params: StructuredOutputsParams) -> str:
        # llguidance builds its parser per matcher; the serialized grammar is what is shared.
        return serialize_guidance_grammar(params)

    def new_grammar(self, compiled: Any) -> StructuredOutputGrammar:
        matcher = llguidance.LLMatcher(self.ll_tokenizer, compiled)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return GuidanceGrammar(matcher, self.ll_tokenizer.eos_token)


def serialize_guidance_grammar(params: StructuredOutputsParams) -> str:
    """The spec as llguidance's serialized grammar (JSON text)."""
    kind, spec = params.kind, params.spec
    defaults: Any = {"whitespace_flexible": not params.disable_any_whitespace}
    if params.whitespace_pattern is not None:
        defaults = {"whitespace_pattern": params.whitespace_pattern}
    if kind == "json":
        if params.disable_additional_properties:
            defaults["additional_properties"] = False
        return str(llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=defaults))
    if kind == "json_object":
        return str(
            llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=defaults)
        )
    if kind == "regex":
        return str(llguidance.grammar_from("regex", spec))
    if kind == "choice":
        return str(llguidance.grammar_from("lark", choice_as_lark(params.choice or [])))
    if kind == "grammar":
        return str(llguidance.grammar_from("grammar", spec))
    tag = json.loads(spec)
    legacy = legacy_structural_tag(tag)
    if legacy is None:
        raise ValueError("guidance takes structural tags of the {structures, triggers} form")
    structures, triggers = legacy
    tags = [
        llguidance.StructTag(
            trigger=next((t for t in triggers if s["begin"].startswith(t)), s["begin"]),
            begin=s["begin"],
            grammar=s["schema"],
            end=s["end"],
        )
        for s in structures
    ]
    return str(llguidance.StructTag.to_grammar(tags))
