"""Repetition (HF-style), frequency and presence (OpenAI-style) penalties, batched."""

from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvserve.sample.metadata import SamplingMetadata


def _output_token_counts(
    output_token_ids: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[N, V] count of each token in each row's output so far."""
    num_rows = len(output_token_ids)
    lengths = torch.tensor([len(out) for out in output_token_ids], dtype=torch.int64)
    flat = torch.tensor(list(chain.from_iterable(output_token_ids)), dtype=torch.int64)
    owner = torch.repeat_interleave(torch.arange(num_rows), lengths)
    counts = torch.zeros(num_rows, vocab_size, dtype=torch.int32, device=device)
    if flat.numel():
        ones = torch.ones(flat.numel(), dtype=torch.int32, device=device)
        counts.index_put_((owner.to(device), flat.to(device)), ones, accumulate=True)
    return counts


def _prompt_token_mask(prompt_token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, V] bool: token appears in the prompt. Padding uses id vocab_size (dropped here)."""
    num_rows = prompt_token_ids.shape[0]
    mask = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=prompt_token_ids.device)
    mask.scatter_(1, prompt_token_ids, True)
    return mask[:, :vocab_size]


def apply_all_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    output_token_ids: list[list[int]],
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """Applies the three penalties in place to logits [N, V]; penalty tensors are [N].

    Repetition divides positive and multiplies negative logits of every token seen in the prompt
    or the output (as HF transformers does); frequency subtracts penalty * count and presence
    subtracts penalty once, over output tokens only (as OpenAI does)."""
    vocab_size = logits.shape[1]
    counts = _output_token_counts(output_token_ids, vocab_size, logits.device)
    output_mask = counts > 0
    seen = _prompt_token_mask(prompt_token_ids, vocab_size) | output_mask
    rep = torch.where(seen, repetition_penalties.unsqueeze(1), 1.0).to(logits.dtype)
    logits.copy_(torch.where(logits > 0, logits / rep, logits * rep))
    logits -= frequency_penalties.unsqueeze(1).to(logits.dtype) * counts
    logits -= presence_penalties.unsqueeze(1).to(logits.dtype) * output_mask
    return logits


def apply_metadata_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """apply_all_penalties with the rows' settings from the metadata (no_penalties: as is)."""
    if metadata.no_penalties:
        return logits
    assert metadata.prompt_token_ids is not None
    assert metadata.presence_penalties is not None
    assert metadata.frequency_penalties is not None
    assert metadata.repetition_penalties is not None
    return apply_all_penalties(
        logits,
        metadata.prompt_token_ids,
        metadata.output_token_ids,
        metadata.presence_penalties,
        metadata.frequency_penalties,
        metadata.repetition_penalties,
    )
