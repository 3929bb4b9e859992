"""The Sampler: logits [N, V] + SamplingMetadata -> one token per row (and raw logprobs)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.protocol.runner_output import LogprobsTensors
from kvserve.sample.logits_processor.interface import LogitsProcessor
from kvserve.sample.metadata import SamplingMetadata
from kvserve.sample.ops.greedy import greedy_tokens
from kvserve.sample.ops.logprobs import compute_prompt_logprobs, gather_logprobs
from kvserve.sample.ops.penalties import apply_metadata_penalties
from kvserve.sample.ops.topk_topp import apply_top_k_top_p, random_sample
from kvserve.sampling_params import _SAMPLING_EPS

__all__ = ["Sampler", "SamplerOutput", "argmax_suffices", "compute_prompt_logprobs"]


def argmax_suffices(metadata: SamplingMetadata) -> bool:
    """Whether the Sampler's tokens for these rows are the logits' argmax and it returns
    nothing else: every row greedy, no penalty, no processor that can move the argmax,
    no logprobs."""
    return (
        metadata.all_greedy
        and metadata.no_penalties
        and metadata.max_num_logprobs is None
        and not _active(metadata.logitsprocs.non_argmax_invariant)
    )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [N]
    logprobs_tensors: LogprobsTensors | None  # rows = N; None when no row asked


class Sampler(torch.nn.Module):
    """vLLM v1 order: raw logprobs; allowed/bad-words/min-tokens/logit-bias processors;
    penalties; greedy argmax; temperature; min_p (argmax-invariant processors); top-k/top-p;
    exponential-race sampling with per-request generators."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if logits.dtype != torch.float32:
            logits = logits.to(torch.float32)
        num_logprobs = metadata.max_num_logprobs
        # Logprobs are those of the model itself, before any processing.
        raw_logprobs = logits.log_softmax(dim=-1) if num_logprobs is not None else None

        procs = _active(metadata.logitsprocs.non_argmax_invariant)
        if metadata.all_greedy and metadata.no_penalties and not procs:
            sampled = greedy_tokens(logits)
        else:
            logits = logits.clone()  # the steps below work in place
            logits = _apply_processors(logits, metadata, procs)
            logits = apply_metadata_penalties(logits, metadata)
            sampled = self.sample(logits, metadata)

        logprobs_tensors = None
        if raw_logprobs is not None and num_logprobs is not None:
            logprobs_tensors = gather_logprobs(raw_logprobs, num_logprobs, sampled)
        return SamplerOutput(sampled, logprobs_tensors)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Greedy rows get exactly the argmax of `logits`; random rows are sampled."""
        greedy = None if metadata.all_random else greedy_tokens(logits)
        if metadata.all_greedy:
            assert greedy is not None
            return greedy
        assert metadata.temperature is not None
        temperature = metadata.temperature
        is_greedy = temperature < _SAMPLING_EPS
        if not metadata.all_random:
            temperature = torch.where(is_greedy, 1.0, temperature)  # a harmless divisor
        logits.div_(temperature.unsqueeze(1).to(logits.dtype))
        logits = _apply_processors(logits, metadata, _active(metadata.logitsprocs.argmax_invariant))
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        sampled = random_sample(_softmax_of_defined(logits), metadata.generators)
        if greedy is None:
            return sampled
        return torch.where(is_greedy, greedy, sampled)


def _softmax_of_defined(logits: torch.Tensor) -> torch.Tensor:
    """The softmax, with rows it leaves undefined (NaN) given a distribution: a penalty or
    temperature near zero overflows logits to inf (and inf - inf is NaN), whose limit is
    the largest logits alone; a row with every token masked takes the whole vocabulary.
    Sampling a NaN row would otherwise give an index past the vocabulary, which fails
    the next step's embedding lookup."""
    probs = logits.softmax(dim=-1)
    undefined = probs[:, 0].isnan()  # a NaN anywhere makes the whole row NaN
    if bool(undefined.any()):
        rows = logits[undefined].nan_to_num(
            nan=float("-inf"), posinf=torch.finfo(logits.dtype).max, neginf=float("-inf")
        )
        rows[rows.isneginf().all(dim=-1)] = 0.0
        probs[undefined] = rows.softmax(dim=-1)
    return probs


def _active(procs: Sequence[LogitsProcessor]) -> list[LogitsProcessor]:
    return [p for p in procs if not p.is_noop()]


def _apply_processors(
    logits: torch.Tensor, metadata: SamplingMetadata, procs: Sequence[LogitsProcessor]
) -> torch.Tensor:
    """Runs batch-level processors, whose row i is batch row i, on the sampling rows."""
    if not procs:
        return logits
    rows = metadata.batch_rows
    if rows is None:
        for proc in procs:
            logits = proc.apply(logits)
        return logits
    # Only some batch rows sample this step: lay them out at their batch rows for the
    # processors (the other rows are zeros nobody reads), then pick them back.
    full = logits.new_zeros(metadata.num_reqs, logits.shape[1])
    full[rows] = logits
    for proc in procs:
        full = proc.apply(full)
    return full[rows]
