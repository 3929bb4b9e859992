"""Per-row sampling state of the persistent input batch."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from torch.nn.utils.rnn import pad_sequence

from kvserve.sample.logits_processor.builtin import BUILTIN_LOGITS_PROCESSORS
from kvserve.sample.logits_processor.interface import LogitsProcessor, MoveDirectionality
from kvserve.sample.logits_processor.state import BatchUpdateBuilder, LogitsProcessors
from kvserve.sample.metadata import SamplingMetadata
from kvserve.sampling_params import _SAMPLING_EPS, SamplingParams

T = TypeVar("T")


class SamplingBatch:
    """Per-row sampling state of the persistent input batch, kept as preallocated CPU tensors
    (copied to the device when a SamplingMetadata is made) and updated incrementally."""

    def __init__(
        self,
        max_num_reqs: int,
        vocab_size: int,
        device: torch.device,
        custom_logitsprocs: Sequence[type[LogitsProcessor]] = (),
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device
        self.is_pin_memory = device.type == "cuda" and torch.cuda.is_available()

        self.temperature_cpu = torch.zeros(max_num_reqs, dtype=torch.float32)
        self.top_p_cpu = torch.ones(max_num_reqs, dtype=torch.float32)
        self.top_k_cpu = torch.full((max_num_reqs,), vocab_size, dtype=torch.int64)
        self.frequency_penalties_cpu = torch.zeros(max_num_reqs, dtype=torch.float32)
        self.presence_penalties_cpu = torch.zeros(max_num_reqs, dtype=torch.float32)
        self.repetition_penalties_cpu = torch.ones(max_num_reqs, dtype=torch.float32)
        self._row_tensors = (
            self.temperature_cpu,
            self.top_p_cpu,
            self.top_k_cpu,
            self.frequency_penalties_cpu,
            self.presence_penalties_cpu,
            self.repetition_penalties_cpu,
        )
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.output_token_ids: list[list[int] | None] = [None] * max_num_reqs
        # Prompt ids as a tensor, only for rows with a repetition penalty (the one user).
        self._prompt_tensors: list[torch.Tensor | None] = [None] * max_num_reqs
        self.generators: dict[int, torch.Generator] = {}
        self.num_logprobs: dict[int, int] = {}  # rows that asked for logprobs; -1 -> vocab
        self._num_rows = 0

        procs = (*BUILTIN_LOGITS_PROCESSORS, *custom_logitsprocs)
        self.logitsprocs = LogitsProcessors(
            cls(max_num_reqs, device, self.is_pin_memory) for cls in procs
        )
        self._batch_update = BatchUpdateBuilder()
        # The metadata of the last step where every row sampled: steps of an unchanged batch
        # reuse it (its tensors only change when rows do; its output token lists are the
        # live ones). Every row change passes through _batch_update, which drops it.
        self._cached: SamplingMetadata | None = None

    def add_logits_processors(self, classes: Sequence[type[LogitsProcessor]]) -> None:
        """Adds custom processors (after the built-ins) to a batch that holds no rows yet."""
        if self._num_rows:
            raise RuntimeError("logits processors can only be added to an empty batch")
        procs = [cls(self.max_num_reqs, self.device, self.is_pin_memory) for cls in classes]
        self.logitsprocs = LogitsProcessors([*self.logitsprocs, *procs])
        self._cached = None

    # ---- batch changes -------------------------------------------------------------------

    def add_request(
        self,
        row: int,
        params: SamplingParams,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        generator: torch.Generator | None,
        eos_token_id: int | None = None,
    ) -> None:
        """Puts a request in `row` (empty, or replaced). `output_token_ids` is the live list the
        runner appends to; `eos_token_id` joins the stop ids that min_tokens blocks."""
        stop_ids = params.all_stop_token_ids
        if eos_token_id is not None and not params.ignore_eos and eos_token_id not in stop_ids:
            params = copy.copy(params)
            params._all_stop_token_ids = [*stop_ids, eos_token_id]
        self._flush_if_moved()
        if self.params[row] is None:
            self._num_rows += 1
        self.params[row] = params
        self.output_token_ids[row] = output_token_ids
        self.temperature_cpu[row] = params.temperature
        self.top_p_cpu[row] = params.top_p
        self.top_k_cpu[row] = (
            params.top_k if 0 < params.top_k < self.vocab_size else self.vocab_size
        )
        self.frequency_penalties_cpu[row] = params.frequency_penalty
        self.presence_penalties_cpu[row] = params.presence_penalty
        self.repetition_penalties_cpu[row] = params.repetition_penalty
        self._prompt_tensors[row] = (
            torch.tensor(prompt_token_ids, dtype=torch.int64)
            if params.repetition_penalty != 1.0
            else None
        )
        self.generators.pop(row, None)
        if generator is not None:
            self.generators[row] = generator
        self.num_logprobs.pop(row, None)
        if params.logprobs is not None:
            self.num_logprobs[row] = self.vocab_size if params.logprobs == -1 else params.logprobs
        self._batch_update.add((row, params, prompt_token_ids, output_token_ids))

    def remove_request(self, row: int) -> None:
        if self.params[row] is None:
            return
        self._flush_if_moved()
        self._num_rows -= 1
        self.params[row] = None
        self.output_token_ids[row] = None
        self._prompt_tensors[row] = None
        self.generators.pop(row, None)
        self.num_logprobs.pop(row, None)
        self._batch_update.remove(row)

    def move_request(self, src: int, dst: int) -> None:
        """Condensing: the request in row src moves into the empty row dst."""
        assert self.params[dst] is None, f"row {dst} is not empty"
        for t in self._row_tensors:
            t[dst] = t[src]
        _move_row(self.params, src, dst)
        _move_row(self.output_token_ids, src, dst)
        _move_row(self._prompt_tensors, src, dst)
        _swap_keys(self.generators, src, dst)  # dst holds nothing, so a swap is a move
        _swap_keys(self.num_logprobs, src, dst)
        self._batch_update.move(src, dst, MoveDirectionality.UNIDIRECTIONAL)

    def swap_requests(self, a: int, b: int) -> None:
        pair = torch.tensor([a, b])
        for t in self._row_tensors:
            t[pair] = t[pair.flip(0)]
        for rows in (self.params, self.output_token_ids, self._prompt_tensors):
            _swap_row(rows, a, b)
        _swap_keys(self.generators, a, b)
        _swap_keys(self.num_logprobs, a, b)
        self._batch_update.move(a, b, MoveDirectionality.SWAP)

    def _flush_if_moved(self) -> None:
        # A BatchUpdate applies adds and removes before moves; an add/remove that comes after a
        # move must therefore reach the processors in a later update.
        if self._batch_update.has_moves():
            self._apply_batch_update()

    def _apply_batch_update(self) -> None:
        """Hand the recorded row changes to the processors; any change retires the metadata
        kept for reuse."""
        update = self._batch_update.get_and_reset(self._num_rows)
        if update is not None:
            self._cached = None
        self.logitsprocs.update_state(update)

    def request_census(self) -> dict[str, int]:
        """Per-row entries still held (row changes not yet handed over are applied first:
        the next step would, and they are no request's state any more)."""
        self._flush_if_moved()
        self._apply_batch_update()
        procs = {f"logits_processor.{k}": v for k, v in self.logitsprocs.request_census().items()}
        return {
            "rows": sum(p is not None for p in self.params),
            "generators": len(self.generators),
            "num_logprobs": len(self.num_logprobs),
            **procs,
        }

    # ---- per step ------------------------------------------------------------------------

    @property
    def num_reqs(self) -> int:
        return self._num_rows

    @property
    def max_num_logprobs(self) -> int | None:
        """Most logprobs any current row asked for (vocab_size for -1); None if none asked."""
        return max(self.num_logprobs.values(), default=None)

    def make_sampling_metadata(
        self, num_reqs: int, rows: torch.Tensor | None = None
    ) -> SamplingMetadata:
        """Metadata for the rows of [0, num_reqs) that sample this step (ascending; None = all).

        Also brings the logits processors up to date, so call it once per step that samples."""
        self._apply_batch_update()
        if rows is not None:
            rows = rows.to("cpu", torch.int64)
            if rows.numel() == num_reqs and torch.equal(rows, torch.arange(num_reqs)):
                rows = None
        if rows is not None:
            return self._make_metadata(num_reqs, rows)
        if self._cached is None or self._cached.num_reqs != num_reqs:
            self._cached = self._make_metadata(num_reqs, None)
        return self._cached

    def _make_metadata(self, num_reqs: int, rows: torch.Tensor | None) -> SamplingMetadata:
        row_list = list(range(num_reqs)) if rows is None else rows.tolist()

        def select(t: torch.Tensor) -> torch.Tensor:
            return t[:num_reqs].clone() if rows is None else t[rows]

        temperature = select(self.temperature_cpu)
        greedy = temperature < _SAMPLING_EPS
        all_greedy = bool(greedy.all())
        all_random = not bool(greedy.any())
        top_p = select(self.top_p_cpu)
        top_k = select(self.top_k_cpu)
        use_top_p = not all_greedy and bool((top_p < 1.0).any())
        use_top_k = not all_greedy and bool((top_k < self.vocab_size).any())

        freq = select(self.frequency_penalties_cpu)
        pres = select(self.presence_penalties_cpu)
        rep = select(self.repetition_penalties_cpu)
        no_penalties = not bool((freq != 0).any() or (pres != 0).any() or (rep != 1).any())
        prompt_ids = None
        if not no_penalties:
            empty = torch.empty(0, dtype=torch.int64)
            prompts = [self._prompt_tensors[r] for r in row_list]
            prompt_ids = pad_sequence(
                [p if p is not None else empty for p in prompts],
                batch_first=True,
                padding_value=self.vocab_size,
            )

        generators: dict[int, torch.Generator] = {}
        if self.generators:
            generators = {
                i: self.generators[r] for i, r in enumerate(row_list) if r in self.generators
            }
        num_logprobs = [self.num_logprobs[r] for r in row_list if r in self.num_logprobs]

        def dev(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or self.device.type == "cpu":
                return t
            return (t.pin_memory() if self.is_pin_memory else t).to(self.device, non_blocking=True)

        output_token_ids = [_live(self.output_token_ids[r]) for r in row_list]
        return SamplingMetadata(
            temperature=None if all_greedy else dev(temperature),
            all_greedy=all_greedy,
            all_random=all_random,
            top_p=dev(top_p) if use_top_p else None,
            top_k=dev(top_k) if use_top_k else None,
            generators=generators,
            max_num_logprobs=max(num_logprobs, default=None),
            no_penalties=no_penalties,
            prompt_token_ids=dev(prompt_ids),
            frequency_penalties=None if no_penalties else dev(freq),
            presence_penalties=None if no_penalties else dev(pres),
            repetition_penalties=None if no_penalties else dev(rep),
            output_token_ids=output_token_ids,
            logitsprocs=self.logitsprocs,
            batch_rows=dev(rows),
            num_reqs=num_reqs,
        )


def _live(token_ids: list[int] | None) -> list[int]:
    # The row's own list even when empty (`or []` would not be): reused metadata must see
    # later appends. An empty row has none.
    return [] if token_ids is None else token_ids


def _move_row(rows: list[T | None], src: int, dst: int) -> None:
    rows[dst], rows[src] = rows[src], None


def _swap_row(rows: list[Any], a: int, b: int) -> None:
    rows[a], rows[b] = rows[b], rows[a]


def _swap_keys(per_row: dict[int, T], a: int, b: int) -> None:
    va, vb = per_row.pop(a, None), per_row.pop(b, None)
    if va is not None:
        per_row[b] = va
    if vb is not None:
        per_row[a] = vb
