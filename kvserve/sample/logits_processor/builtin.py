"""The built-in logits processors: min_p, logit_bias, min_tokens, allowed_token_ids, bad_words,
begin_suppress (the model's tokens never emitted first)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import torch

from kvserve.sample.logits_processor.interface import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)
from kvserve.sampling_params import SamplingParams

S = TypeVar("S")


class RowStateLogitsProcessor(LogitsProcessor, Generic[S]):
    """A processor whose per-row state is a dict row -> S, holding only the rows that use it.

    Subclasses say which state a new request gets and turn the dict into tensors; the batch
    bookkeeping (add/remove/move/swap) lives here once."""

    def __init__(self, max_num_reqs: int, device: torch.device, is_pin_memory: bool) -> None:
        self.max_num_reqs = max_num_reqs
        self.device = device
        self.is_pin_memory = is_pin_memory
        self.states: dict[int, S] = {}
        # Tensors are rebuilt lazily in apply(), where the vocabulary size is known.
        self._dirty = True

    @abstractmethod
    def new_state(
        self, params: SamplingParams, prompt_tok_ids: list[int], output_tok_ids: list[int]
    ) -> S | None:
        """The state of a newly added request, or None if it does not use this processor."""

    def refresh(self) -> bool:
        """Drops states that stopped applying (called every step); True if any changed."""
        return False

    def rebuild(self, vocab_size: int) -> None:
        """Rebuilds the device tensors from `states`."""

    def is_noop(self) -> bool:
        return not self.states

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None and not self.states:
            return  # nothing to add, drop or refresh: most steps of most batches
        changed = False
        if batch_update is not None:
            for row, params, prompt, output in batch_update.added:
                state = self.new_state(params, prompt, output)
                if state is None:
                    changed |= self.states.pop(row, None) is not None
                else:
                    self.states[row] = state
                    changed = True
            for row in batch_update.removed:
                changed |= self.states.pop(row, None) is not None
            for src, dst, direction in batch_update.moved:
                src_state = self.states.pop(src, None)
                dst_state = self.states.pop(dst, None)
                if direction == MoveDirectionality.SWAP and dst_state is not None:
                    self.states[src] = dst_state
                if src_state is not None:
                    self.states[dst] = src_state
                changed |= src_state is not None or dst_state is not None
        changed |= self.refresh()
        self._dirty |= changed

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.states:
            return logits
        if self._dirty:
            self.rebuild(logits.shape[-1])
            self._dirty = False
        return self.apply_to(logits)

    @abstractmethod
    def apply_to(self, logits: torch.Tensor) -> torch.Tensor:
        """apply() for a non-empty batch with up-to-date tensors."""

    def _tensor(self, data: Sequence[Any], dtype: torch.dtype) -> torch.Tensor:
        cpu = torch.tensor(data, dtype=dtype)
        if self.is_pin_memory:
            cpu = cpu.pin_memory()
        return cpu.to(self.device, non_blocking=True)


class MinPLogitsProcessor(RowStateLogitsProcessor[float]):
    """Masks tokens whose probability is below min_p times the row's top probability."""

    def new_state(
        self, params: SamplingParams, prompt: list[int], output: list[int]
    ) -> float | None:
        return params.min_p if params.min_p > 0.0 else None

    def is_argmax_invariant(self) -> bool:
        return True  # the top token always survives

    def rebuild(self, vocab_size: int) -> None:
        self._rows = self._tensor(list(self.states), torch.int64)
        self._min_p = self._tensor(list(self.states.values()), torch.float32).unsqueeze(1)

    def apply_to(self, logits: torch.Tensor) -> torch.Tensor:
        sub = logits[self._rows]
        probs = sub.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * self._min_p
        logits[self._rows] = sub.masked_fill_(probs < threshold, float("-inf"))
        return logits


class _SparseEdit(RowStateLogitsProcessor[S]):
    """A processor that touches a few (row, token) pairs, kept as index tensors."""

    @abstractmethod
    def pairs(self) -> tuple[list[int], list[int], list[float]]:
        """(rows, token ids, values) over all states."""

    def rebuild(self, vocab_size: int) -> None:
        rows, toks, vals = self.pairs()
        self._index = (self._tensor(rows, torch.int64), self._tensor(toks, torch.int64))
        self._values = self._tensor(vals, torch.float32)


class LogitBiasLogitsProcessor(_SparseEdit[dict[int, float]]):
    """Adds the request's logit_bias to the chosen tokens' logits."""

    def new_state(
        self, params: SamplingParams, prompt: list[int], output: list[int]
    ) -> dict[int, float] | None:
        return params.logit_bias or None

    def is_argmax_invariant(self) -> bool:
        return False

    def pairs(self) -> tuple[list[int], list[int], list[float]]:
        rows, toks, vals = [], [], []
        for row, bias in self.states.items():
            rows += [row] * len(bias)
            toks += list(bias)
            vals += list(bias.values())
        return rows, toks, vals

    def apply_to(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_put_(self._index, self._values.to(logits.dtype), accumulate=True)


class MinTokensLogitsProcessor(_SparseEdit[tuple[int, list[int], list[int]]]):
    """Blocks the stop tokens (eos included unless ignore_eos) until min_tokens are output."""

    def new_state(
        self, params: SamplingParams, prompt: list[int], output: list[int]
    ) -> tuple[int, list[int], list[int]] | None:
        stop_ids = params.all_stop_token_ids
        if params.min_tokens <= 0 or not stop_ids or len(output) >= params.min_tokens:
            return None
        return params.min_tokens, output, list(stop_ids)

    def is_argmax_invariant(self) -> bool:
        return False

    def refresh(self) -> bool:
        done = [row for row, (min_toks, out, _) in self.states.items() if len(out) >= min_toks]
        for row in done:
            del self.states[row]
        return bool(done)

    def pairs(self) -> tuple[list[int], list[int], list[float]]:
        rows, toks = [], []
        for row, (_, _, stop_ids) in self.states.items():
            rows += [row] * len(stop_ids)
            toks += stop_ids
        return rows, toks, [float("-inf")] * len(rows)

    def apply_to(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_put_(self._index, self._values.to(logits.dtype))


class BeginSuppressLogitsProcessor(_SparseEdit[tuple[list[int], list[int]]]):
    """Blocks the model's begin_suppress tokens for a request's first output token only
    (HF's SuppressTokensAtBeginLogitsProcessor: Whisper never starts with EOT or a space)."""

    def new_state(
        self, params: SamplingParams, prompt: list[int], output: list[int]
    ) -> tuple[list[int], list[int]] | None:
        ids = params.begin_suppress_token_ids
        return (ids, output) if ids and not output else None

    def is_argmax_invariant(self) -> bool:
        return False

    def refresh(self) -> bool:
        started = [row for row, (_, out) in self.states.items() if out]
        for row in started:
            del self.states[row]
        return bool(started)

    def pairs(self) -> tuple[list[int], list[int], list[float]]:
        rows, toks = [], []
        for row, (ids, _) in self.states.items():
            rows += [row] * len(ids)
            toks += ids
        return rows, toks, [float("-inf")] * len(rows)

    def apply_to(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_put_(self._index, self._values.to(logits.dtype))


class AllowedTokenIdsLogitsProcessor(RowStateLogitsProcessor[list[int]]):
    """Masks every token outside the request's allowed_token_ids."""

    def new_state(
        self, params: SamplingParams, prompt: list[int], output: list[int]
    ) -> list[int] | None:
        return params.allowed_token_ids or None

    def is_argmax_invariant(self) -> bool:
        return False

    def rebuild(self, vocab_size: int) -> None:
        self._rows = self._tensor(list(self.states), torch.int64)
        lens = [len(ids) for ids in self.states.values()]
        owner = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        ids = torch.tensor([t for ids in self.states.values() for t in ids], dtype=torch.int64)
        # One [n, V] disallowed mask for the rows that restrict tokens, kept on the device.
        mask = torch.ones(len(lens), vocab_size, dtype=torch.bool)
        mask[owner, ids] = False
        self._mask = mask.to(self.device, non_blocking=True)

    def apply_to(self, logits: torch.Tensor) -> torch.Tensor:
        logits[self._rows] = logits[self._rows].masked_fill_(self._mask, float("-inf"))
        return logits


class BadWordsLogitsProcessor(RowStateLogitsProcessor[tuple[list[list[int]], list[int]]]):
    """Masks the last token of each bad word whose earlier tokens end the output so far."""

    def new_state(
        self, params: SamplingParams, prompt: list[int], output: list[int]
    ) -> tuple[list[list[int]], list[int]] | None:
        words = [w for w in params.bad_words_token_ids or [] if w]
        return (words, output) if words else None

    def is_argmax_invariant(self) -> bool:
        return False

    def apply_to(self, logits: torch.Tensor) -> torch.Tensor:
        # The prefix match depends on each request's own output, so it is a per-request check;
        # the masking itself is one batched index_put_.
        rows: list[int] = []
        toks: list[int] = []
        for row, (words, output) in self.states.items():
            for word in words:
                prefix_len = len(word) - 1
                if prefix_len == 0 or (
                    prefix_len <= len(output) and output[-prefix_len:] == word[:-1]
                ):
                    rows.append(row)
                    toks.append(word[-1])
        if rows:
            index = (self._tensor(rows, torch.int64), self._tensor(toks, torch.int64))
            logits.index_put_(index, torch.tensor(float("-inf"), device=logits.device))
        return logits


BUILTIN_LOGITS_PROCESSORS: tuple[type[LogitsProcessor], ...] = (
    AllowedTokenIdsLogitsProcessor,
    BadWordsLogitsProcessor,
    MinTokensLogitsProcessor,
    BeginSuppressLogitsProcessor,
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
)
