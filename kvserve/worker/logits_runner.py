"""What the model runner does with a step's logits besides sampling them: the grammar
masks of constrained requests, and logprobs (per sampled token and per prompt token).
A component the runner holds; it keeps no per-request state (a request's prompt-logprobs
progress is on its CachedRequestState)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from kvserve.protocol.runner_output import LogprobsLists, LogprobsTensors
from kvserve.protocol.scheduler_output import GrammarOutput
from kvserve.sample.sampler import compute_prompt_logprobs
from kvserve.structured_output.bitmask import apply_grammar_bitmask

if TYPE_CHECKING:
    from kvserve.worker.input_batch import InputBatch
    from kvserve.worker.input_preparation import StepInputs


class ComputesLogits(Protocol):
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor: ...


class LogitsRunner:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    @staticmethod
    def apply_grammar_bitmask(
        batch: InputBatch,
        logits: torch.Tensor,
        sample_rows: np.ndarray,
        grammar_output: GrammarOutput,
        first_logits_row: np.ndarray | None = None,
    ) -> None:
        """Masks the constrained requests' logits rows to the tokens their grammars allow.
        Row i of logits is the request in batch row sample_rows[i], or with drafts in the
        step row first_logits_row[i] (a constrained request has no drafts: one row)."""
        starts = range(len(sample_rows)) if first_logits_row is None else first_logits_row.tolist()
        logits_row_of = {
            int(row): int(s) for row, s in zip(sample_rows.tolist(), starts, strict=False)
        }
        index = batch.req_id_to_index
        # The scheduler lists exactly the sampling rows; a request missing here is a bug
        # upstream and fails the step (KeyError) rather than sampling unconstrained.
        # A request with drafts has consecutive rows: its positions in order.
        seen: dict[str, int] = {}
        rows = []
        for r in grammar_output.structured_output_request_ids:
            rows.append(logits_row_of[index[r]] + seen.get(r, 0))
            seen[r] = seen.get(r, 0) + 1
        apply_grammar_bitmask(logits, rows, grammar_output.grammar_bitmask)

    @staticmethod
    def logprobs_by_row(
        tensors: LogprobsTensors, sample_rows: np.ndarray, num_reqs: int
    ) -> LogprobsLists:
        """Spread the sampling rows' logprobs over all batch rows (others hold zeros)."""
        if len(sample_rows) == num_reqs:
            return tensors.tolists()
        idx = torch.from_numpy(sample_rows).to(tensors.logprobs.device)

        def spread(t: torch.Tensor) -> torch.Tensor:
            full = t.new_zeros((num_reqs, *t.shape[1:]))
            return full.index_copy_(0, idx, t)

        return LogprobsTensors(*(spread(t) for t in tensors)).tolists()

    @staticmethod
    def wants_prompt_logprobs(batch: InputBatch) -> bool:
        return any(s is not None and s.num_prompt_logprobs is not None for s in batch.requests)

    def prompt_logprobs(
        self,
        batch: InputBatch,
        inputs: StepInputs,
        hidden_states: torch.Tensor | None,
        model: ComputesLogits,
    ) -> dict[str, LogprobsTensors | None]:
        """Prompt logprobs of the positions computed this step: the logits at position p
        score prompt token p+1, so a request's final chunk stops at its last prompt token.
        ``hidden_states``: the step's, kept only when some request asked (None: none)."""
        if hidden_states is None:
            return {}
        result: dict[str, LogprobsTensors | None] = {}
        for row, request in enumerate(batch.requests):
            if request is None or request.num_prompt_logprobs is None:
                continue
            num_logprobs = request.num_prompt_logprobs
            if num_logprobs == -1:
                num_logprobs = self.vocab_size
            start = int(batch.num_computed_tokens_cpu[row])
            num_prompt = request.num_prompt_tokens
            end = min(start + int(inputs.num_scheduled_tokens[row]), num_prompt - 1)
            if end > start:
                offset = int(inputs.query_start_loc_np[row])
                hidden = hidden_states[offset : offset + end - start]
                targets = torch.from_numpy(batch.token_ids_cpu[row, start + 1 : end + 1])
                logits = model.compute_logits(hidden)
                tensors = compute_prompt_logprobs(
                    logits, targets.to(logits.device, torch.int64), num_logprobs
                )
                result[request.req_id] = LogprobsTensors(*(t.cpu() for t in tensors))
            if start + int(inputs.num_scheduled_tokens[row]) >= num_prompt:
                request.prompt_logprobs_done = True
        return result
