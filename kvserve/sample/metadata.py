"""Everything the Sampler needs about the rows it samples in one step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.sample.logits_processor.state import LogitsProcessors


@dataclass
class SamplingMetadata:
    """Row i of every [N] tensor (and of the logits) is the i-th sampling row of the batch."""

    # [N] float32; greedy rows hold 0.0. None when all rows are greedy.
    temperature: torch.Tensor | None
    all_greedy: bool
    all_random: bool
    # [N] float32 (1.0 = off) / int64 (vocab_size = off); None when no row uses the filter.
    top_p: torch.Tensor | None
    top_k: torch.Tensor | None
    # Sampling row index -> the request's own generator (seeded requests).
    generators: dict[int, torch.Generator]
    # Top-k logprobs to return per row (vocab_size for -1); None when no row asked.
    max_num_logprobs: int | None
    no_penalties: bool
    # [N, P] padded with vocab_size; None when no_penalties.
    prompt_token_ids: torch.Tensor | None
    # [N] each; None when no_penalties.
    frequency_penalties: torch.Tensor | None
    presence_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    # The live output token lists of the N rows.
    output_token_ids: list[list[int]]
    # Processors over the whole persistent batch (their row i is batch row i, not sampling
    # row i); batch_rows maps sampling rows to batch rows (None = identity over num_reqs rows).
    logitsprocs: LogitsProcessors = field(default_factory=LogitsProcessors)
    batch_rows: torch.Tensor | None = None
    num_reqs: int = 0
