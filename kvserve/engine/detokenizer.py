"""Incremental detokenization of one request's output tokens, with stop-string detection."""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from kvserve.protocol.engine_core import EngineCoreRequest
from kvserve.utils.census import per_request

if TYPE_CHECKING:
    # Annotations only: transformers loads when a tokenizer is built, not on import.
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Prompt tokens fed to the decoder before the output, so the first output token is decoded
# in context (e.g. a SentencePiece "▁word" keeps its space); enough to span one character.
_MIN_PRIMING_TOKENS = 4
_MAX_PRIMING_TOKENS = 24
_INVALID_PREFIX_ERR = "Invalid prefix encountered"


def _safe_prompt_suffix(prompt: list[int], decode: Callable[[list[int]], str]) -> list[int]:
    """The shortest prompt suffix (>= a few tokens) that decodes without a dangling half
    character, so priming a decoder with it cannot leak prompt bytes into the output."""
    if len(prompt) <= _MIN_PRIMING_TOKENS:
        candidates = [prompt]
    else:
        top = min(len(prompt), _MAX_PRIMING_TOKENS)
        candidates = [prompt[-n:] for n in range(_MIN_PRIMING_TOKENS, top + 1)]
    return next((c for c in candidates if "\ufffd" not in decode(c)), [])


@per_request
class IncrementalDetokenizer:
    """Tracks output token ids only: used when there is no tokenizer or detokenize=False."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids

    @property
    def output_text(self) -> str:
        return ""

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Adds new tokens; returns the stop string that ended the text, if one did."""
        self.token_ids.extend(new_token_ids)
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        return ""

    @classmethod
    def from_new_request(
        cls, tokenizer: PreTrainedTokenizerBase | None, request: EngineCoreRequest
    ) -> IncrementalDetokenizer:
        if tokenizer is None or not request.sampling_params.detokenize:
            return IncrementalDetokenizer()
        backend = getattr(tokenizer, "_tokenizer", None)
        if tokenizer.is_fast and isinstance(backend, Tokenizer):
            return FastIncrementalDetokenizer(tokenizer, request)
        return SlowIncrementalDetokenizer(tokenizer, request)


class BaseIncrementalDetokenizer(IncrementalDetokenizer):
    """Text bookkeeping shared by both decoders: stop strings, min_tokens, streamed deltas."""

    def __init__(self, request: EngineCoreRequest) -> None:
        super().__init__()
        params = request.sampling_params
        self.stop: list[str] = list(params.stop or [])
        self.min_tokens = params.min_tokens
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.skip_special_tokens = params.skip_special_tokens
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        # Streamed text holds back this many chars, so a stop string that is still being
        # completed is never sent and then taken back.
        self.stop_buffer_length = (
            self._max_stop_len - 1 if self.stop and not self.include_stop_str_in_output else 0
        )
        self._output_text = ""
        self._last_output_text_offset = 0
        self._stopped = False

    @property
    def output_text(self) -> str:
        return self._output_text

    @abstractmethod
    def decode_next(self, token_id: int) -> str:
        """The text that ``token_id`` adds (may be "" while a character is incomplete)."""

    def flush(self) -> str:
        """Text still buffered in the decoder when the request ends (incomplete bytes)."""
        return ""

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        if not new_token_ids:
            return None
        to_decode = new_token_ids
        if stop_terminated and not self.include_stop_str_in_output:
            # The EOS / stop token itself is not part of the text.
            to_decode = new_token_ids[:-1]
        check_from = length = len(self._output_text)
        pieces: list[str] = []
        for token_id in to_decode:
            self.token_ids.append(token_id)
            piece = self.decode_next(token_id)
            pieces.append(piece)
            length += len(piece)
            if len(self.token_ids) <= self.min_tokens:
                # Text of the first min_tokens tokens may not end the request.
                check_from = length
        if len(to_decode) < len(new_token_ids):
            self.token_ids.append(new_token_ids[-1])
        self._output_text += "".join(pieces)
        if self._stopped or not self.stop or len(self.token_ids) <= self.min_tokens:
            return None
        return self._check_stop_strings(check_from)

    def _check_stop_strings(self, check_from: int) -> str | None:
        """Finds the earliest stop string that ends after ``check_from``; truncates there."""
        text = self._output_text
        if check_from >= len(text):
            return None
        best: tuple[int, str] | None = None
        for stop_str in self.stop:
            # Only a match that ends in the new text is new; older text was checked before.
            start = max(0, check_from - len(stop_str) + 1)
            idx = text.find(stop_str, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop_str)
        if best is None:
            return None
        idx, stop_str = best
        end = idx + len(stop_str) if self.include_stop_str_in_output else idx
        self._output_text = text[:end]
        self._stopped = True
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        if finished and not self._stopped:
            self._output_text += self.flush()
        hold = 0 if finished else self.stop_buffer_length
        end = len(self._output_text) - hold
        if not delta:
            return self._output_text[:end] if hold else self._output_text
        start = self._last_output_text_offset
        if start >= end:
            return ""
        self._last_output_text_offset = end
        return self._output_text[start:end]


@per_request
class FastIncrementalDetokenizer(BaseIncrementalDetokenizer):
    """Streams text with the Rust ``tokenizers.decoders.DecodeStream`` (fast tokenizers)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, request: EngineCoreRequest) -> None:
        super().__init__(request)
        self.tokenizer: Tokenizer = tokenizer._tokenizer  # type: ignore[attr-defined]
        self._pending: list[int] = []  # ids fed since the stream last produced text
        self._prime_ids = _safe_prompt_suffix(
            request.prompt_token_ids,
            lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens),
        )
        self.stream = self._new_stream()

    def _new_stream(self) -> DecodeStream:
        stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        for token_id in self._prime_ids:
            stream.step(self.tokenizer, token_id)
        return stream

    def decode_next(self, token_id: int) -> str:
        try:
            text = self.stream.step(self.tokenizer, token_id)
        except (OverflowError, TypeError):
            text = None  # an id the tokenizer cannot map; nothing to show for it
        except Exception as e:
            if not str(e).startswith(_INVALID_PREFIX_ERR):
                raise
            # Some byte-level outputs make the stream's prefix non-monotonic; restart it.
            logger.debug("DecodeStream reset after %r", e)
            self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            text = self.stream.step(self.tokenizer, token_id)
        if text is None:
            self._pending.append(token_id)
            return ""
        self._pending.clear()
        return text

    def flush(self) -> str:
        # Decoding the leftover bytes alone yields what a full decode puts at the end ("�").
        if not self._pending:
            return ""
        text = self.tokenizer.decode(self._pending, skip_special_tokens=self.skip_special_tokens)
        self._pending.clear()
        return text


@per_request
class SlowIncrementalDetokenizer(BaseIncrementalDetokenizer):
    """Prefix/read-offset decoding for tokenizers without a Rust backend."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, request: EngineCoreRequest) -> None:
        super().__init__(request)
        self.tokenizer = tokenizer
        self._special_ids = set(tokenizer.all_special_ids)
        # Decoding always restarts from a few context tokens back, so merges and spacing
        # at the boundary come out as in a full decode; the prompt supplies the first ones.
        prompt = [
            t
            for t in request.prompt_token_ids
            if not (self.skip_special_tokens and t in self._special_ids)
        ]
        prime = _safe_prompt_suffix(prompt, lambda ids: self._to_string(self._ids_to_tokens(ids)))
        self._tokens: list[str] = self._ids_to_tokens(prime)
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)

    def decode_next(self, token_id: int) -> str:
        if self.skip_special_tokens and token_id in self._special_ids:
            return ""
        self._tokens.extend(self._ids_to_tokens([token_id]))
        prefix_text = self._to_string(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._to_string(self._tokens[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the next token
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        tail = self._to_string(self._tokens[self._read_offset :])
        self._read_offset = len(self._tokens)
        return tail

    def _ids_to_tokens(self, ids: list[int]) -> list[str]:
        tokens = self.tokenizer.convert_ids_to_tokens(ids)
        return [tokens] if isinstance(tokens, str) else list(tokens)

    def _to_string(self, tokens: list[str]) -> str:
        if not tokens:
            return ""
        return self.tokenizer.convert_tokens_to_string(tokens)
