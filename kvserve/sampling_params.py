"""Sampling parameters with vLLM's field names, defaults and validation."""

from __future__ import annotations

import json
import math
from enum import IntEnum
from typing import Any

import msgspec

_SAMPLING_EPS = 1e-5


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0  # every output carries all text and tokens so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # a single output when the request finishes


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _bad(field: str, why: str, value: Any) -> ValueError:
    return ValueError(f"{field} {why}, got {value!r}")


class ReasoningTokens(msgspec.Struct, kw_only=True):
    """A thinking model's think-start and think-end token ids (its reasoning parser's)."""

    start_token_ids: list[int]
    end_token_ids: list[int]


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One grammar constraint on a request's output (vLLM's StructuredOutputsParams).

    Exactly one of json, json_object, regex, choice, grammar, structural_tag is set. A JSON
    schema given as a dict is kept as its JSON text, so the struct crosses processes as
    typed msgspec data and its cache key is a plain string.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (xgrammar's GBNF dialect) or Lark
    json_object: bool | None = None
    structural_tag: str | None = None  # JSON text: {"structures": [...], "triggers": [...]}
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    # The backend that runs it; the input processor fills it in from the engine's setting.
    _backend: str | None = None
    # Set by the API server for a thinking model: the grammar constrains only the tokens
    # after the reasoning ends (vLLM's reasoning_ended), not the reasoning itself.
    _reasoning: ReasoningTokens | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            self.json = json.dumps(self.json)
        kinds = [k for k in _CONSTRAINT_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(_CONSTRAINT_KINDS)}, got {kinds or 'none'}"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise _bad(
                "structured_outputs.choice", "must be a list of non-empty strings", self.choice
            )

    @property
    def kind(self) -> str:
        """The constraint's kind: one of json, json_object, regex, choice, grammar,
        structural_tag."""
        return next(k for k in _CONSTRAINT_KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text (choices as a JSON list): with kind, the grammar's identity."""
        value = getattr(self, self.kind)
        if self.kind == "choice":
            return json.dumps(value)
        return "" if value is True else str(value)


_CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How to sample one request's tokens; a msgspec Struct so it crosses processes."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # A grammar the output must follow (JSON schema, regex, choice, EBNF, structural tag).
    structured_outputs: StructuredOutputsParams | None = None
    # Free-form extras for plug-ins (vLLM's field); "kv_transfer_params" goes to the KV
    # connector as the request's kv_transfer_params.
    extra_args: dict[str, Any] | None = None
    # Filled in by the input processor: bad_words tokenized (and the model's suppressed
    # tokens as one-token words), the tokens it never emits first, eos of the model.
    _bad_words_token_ids: list[list[int]] | None = None
    _begin_suppress_token_ids: list[int] | None = None
    _all_stop_token_ids: list[int] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        self._verify_numbers()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias:
            # JSON object keys arrive as strings.
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if 0 < self.temperature < _SAMPLING_EPS:
            self.temperature = 0.0
        self._verify()
        if self.temperature == 0.0:
            # Greedy: the filters cannot change the argmax, so drop them.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        # Keep ids the input processor added (extra EOS ids) when the struct is rebuilt by
        # clone() or decoded in another process: both run __post_init__ again.
        self._all_stop_token_ids = list(
            dict.fromkeys([*self.stop_token_ids, *self._all_stop_token_ids])
        )

    def _verify_numbers(self) -> None:
        """Types first: the normalisation in __post_init__ compares these numbers."""
        # NaN passes every range check below (all comparisons are false) and makes the
        # sampler draw garbage token ids; infinities are no sampling setting either.
        for field in (
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "temperature",
            "top_p",
            "min_p",
        ):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise _bad(field, "must be a number", value)
            if not math.isfinite(value):
                raise _bad(field, "must be a finite number", value)
        for field in ("n", "top_k", "min_tokens"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int):
                raise _bad(field, "must be an integer", value)
        for field in ("max_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise _bad(field, "must be an integer or None", value)

    def _verify(self) -> None:
        for token_id, bias in (self.logit_bias or {}).items():
            if not math.isfinite(bias):
                raise _bad(f"logit_bias[{token_id}]", "must be a finite number", bias)
        if not isinstance(self.n, int) or self.n < 1:
            raise _bad("n", "must be at least 1", self.n)
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise _bad("presence_penalty", "must be in [-2, 2]", self.presence_penalty)
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise _bad("frequency_penalty", "must be in [-2, 2]", self.frequency_penalty)
        if not self.repetition_penalty > 0.0:
            raise _bad("repetition_penalty", "must be greater than zero", self.repetition_penalty)
        if self.temperature < 0.0:
            raise _bad("temperature", "must be non-negative", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise _bad("top_p", "must be in (0, 1]", self.top_p)
        if self.top_k < 0:
            raise _bad("top_k", "must be 0 or -1 (disabled) or at least 1", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            raise _bad("min_p", "must be in [0, 1]", self.min_p)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise _bad("max_tokens", "must be at least 1", self.max_tokens)
        if self.min_tokens < 0:
            raise _bad("min_tokens", "must be greater than or equal to 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad(
                "min_tokens",
                f"must be less than or equal to max_tokens={self.max_tokens}",
                self.min_tokens,
            )
        if self.logprobs is not None and self.logprobs < -1:
            raise _bad("logprobs", "must be non-negative or -1 (whole vocabulary)", self.logprobs)
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            raise _bad("prompt_logprobs", "must be non-negative or -1", self.prompt_logprobs)
        assert isinstance(self.stop, list)
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63
        ):
            raise _bad("seed", "must be a 64-bit integer", self.seed)
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            raise ValueError("allowed_token_ids must not be empty")
        if self.n > 1 and self.temperature == 0.0 and self.seed is None:
            # vLLM allows it (all n samples are identical); nothing to reject.
            pass

    def verify_against_vocab(self, vocab_size: int) -> None:
        """Checks token ids given by the user against the model's vocabulary."""
        for field, ids in (
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("stop_token_ids", self.stop_token_ids or []),
            ("logit_bias", list((self.logit_bias or {}).keys())),
        ):
            out = [t for t in ids if not 0 <= t < vocab_size]
            if out:
                raise ValueError(
                    f"{field} contains token ids outside the vocabulary "
                    f"[0, {vocab_size}): {out[:5]}"
                )

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature == 0.0:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def all_stop_token_ids(self) -> list[int]:
        return self._all_stop_token_ids

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        return self._bad_words_token_ids

    @property
    def begin_suppress_token_ids(self) -> list[int] | None:
        return self._begin_suppress_token_ids

    def clone(self, **changes: Any) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)


class BeamSearchParams(msgspec.Struct, kw_only=True):
    """vLLM's beam search settings (``LLM.beam_search``; ``use_beam_search`` on the server)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int):
            raise _bad("beam_width", "must be an integer", self.beam_width)
        if self.beam_width < 1:
            raise _bad("beam_width", "must be at least 1", self.beam_width)
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise _bad("max_tokens", "must be an integer", self.max_tokens)
        if self.max_tokens < 1:
            raise _bad("max_tokens", "must be at least 1", self.max_tokens)
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise _bad(name, "must be a number", value)
            if not math.isfinite(value):
                raise _bad(name, "must be a finite number", value)
        if self.temperature < 0.0:
            raise _bad("temperature", "must be non-negative", self.temperature)
