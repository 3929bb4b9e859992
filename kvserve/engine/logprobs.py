"""Turns the engine core's logprob rows into per-position {token_id: Logprob} dicts."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from kvserve.outputs import Logprob, PromptLogprobs, SampleLogprobs
from kvserve.protocol.engine_core import EngineCoreOutput, EngineCoreRequest

if TYPE_CHECKING:
    # Annotations only: transformers loads when a tokenizer is built, not on import.
    from transformers import PreTrainedTokenizerBase


class LogprobsProcessor:
    """Accumulates one request's sample and prompt logprobs.

    Each row from the core is ``[chosen, top-1, ..., top-k]`` ids with their logprobs and
    the chosen token's vocabulary rank; the chosen token (sampled, or the actual prompt
    token) comes first in the dict, the top-k follow with ranks 1..k.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        num_logprobs: int | None,
        num_prompt_logprobs: int | None,
    ) -> None:
        self.tokenizer = tokenizer
        self.num_logprobs = num_logprobs
        self.num_prompt_logprobs = num_prompt_logprobs
        self.logprobs: SampleLogprobs | None = None if num_logprobs is None else []
        self.cumulative_logprob: float | None = None if num_logprobs is None else 0.0
        # Nothing predicts the first prompt token, hence the leading None.
        self.prompt_logprobs: PromptLogprobs | None = (
            None if num_prompt_logprobs is None else [None]
        )
        self._prompt_logprobs_sent = 0

    @classmethod
    def from_new_request(
        cls, tokenizer: PreTrainedTokenizerBase | None, request: EngineCoreRequest
    ) -> LogprobsProcessor:
        params = request.sampling_params
        return cls(tokenizer, params.logprobs, params.prompt_logprobs)

    def update_from_output(self, output: EngineCoreOutput) -> None:
        if (
            self.logprobs is not None
            and output.new_logprobs_token_ids is not None
            and output.new_logprobs is not None
            and output.new_sampled_token_ranks is not None
        ):
            rows = self._to_dicts(
                output.new_logprobs_token_ids, output.new_logprobs, output.new_sampled_token_ranks
            )
            self.logprobs.extend(rows)
            assert self.cumulative_logprob is not None
            self.cumulative_logprob += sum(lps[0] for lps in output.new_logprobs)
        if (
            self.prompt_logprobs is not None
            and output.new_prompt_logprobs_token_ids is not None
            and output.new_prompt_logprobs is not None
            and output.new_prompt_logprobs_ranks is not None
        ):
            self.prompt_logprobs.extend(
                self._to_dicts(
                    output.new_prompt_logprobs_token_ids,
                    output.new_prompt_logprobs,
                    output.new_prompt_logprobs_ranks,
                )
            )

    def pop_prompt_logprobs(self) -> PromptLogprobs | None:
        """Prompt logprob positions not handed out yet (for DELTA outputs)."""
        if self.prompt_logprobs is None:
            return None
        new = self.prompt_logprobs[self._prompt_logprobs_sent :]
        self._prompt_logprobs_sent = len(self.prompt_logprobs)
        return new

    def _to_dicts(
        self, token_ids: list[list[int]], logprobs: list[list[float]], ranks: list[int]
    ) -> list[dict[int, Logprob]]:
        decoded = self._decode_each(token_ids)
        out: list[dict[int, Logprob]] = []
        for row_ids, row_lps, rank, row_text in zip(
            token_ids, logprobs, ranks, decoded, strict=True
        ):
            row_ranks = itertools.chain((rank,), range(1, len(row_ids)))
            out.append(
                {
                    tid: Logprob(lp, r, text)
                    for tid, lp, r, text in zip(row_ids, row_lps, row_ranks, row_text, strict=True)
                }
            )
        return out

    def _decode_each(self, token_ids: list[list[int]]) -> list[list[str | None]]:
        # Every id is decoded on its own (as vLLM does), all rows in one batched call.
        if self.tokenizer is None:
            return [[None] * len(row) for row in token_ids]
        flat = [[tid] for row in token_ids for tid in row]
        texts = iter(self.tokenizer.batch_decode(flat, skip_special_tokens=False))
        return [[next(texts) for _ in row] for row in token_ids]
