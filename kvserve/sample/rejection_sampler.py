"""The RejectionSampler: verifies a step's drafts against the target model's logits.

Greedy rows keep drafts while they equal the target's argmax and then emit the argmax, so
the output is token for token the non-speculative greedy output. Random rows use the
standard rule (Leviathan et al., Chen et al.): draft token d with draft probability q(d) is
accepted with probability min(1, p(d) / q(d)); on rejection a token is drawn from
normalize(max(p - q, 0)); when every draft is accepted a bonus token is drawn from p. The
emitted tokens are then distributed exactly as target samples. Deterministic proposers
(n-gram lookup, a greedy draft model: no draft_probs) have a one-hot q, so acceptance is p(d)
and the recovered distribution is p without d: both follow from drawing the token from p
and accepting the draft when they agree, which spends one draw per emitted token, so
seeded requests are reproducible whatever the drafts.

p is the distribution the plain Sampler would sample from at that position: the logits
processors, penalties, temperature, min-p and top-k/top-p all apply. Position j of a row
is processed as if drafts 0..j-1 had already been emitted: they are appended to the
request's live output list for the duration (penalties and processors read that list),
and the list is restored before returning. Processors must therefore derive any
output-dependent state from the live list (the built-ins do; min_tokens, whose state
ends once reached, is kept from straddling positions by the scheduler's draft cap).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.protocol.runner_output import LogprobsTensors
from kvserve.sample.metadata import SamplingMetadata
from kvserve.sample.ops.greedy import greedy_tokens
from kvserve.sample.ops.logprobs import gather_logprobs
from kvserve.sample.ops.penalties import apply_metadata_penalties
from kvserve.sample.ops.topk_topp import apply_top_k_top_p, random_sample
from kvserve.sample.sampler import _active, _apply_processors, _softmax_of_defined
from kvserve.sample.spec_decode_metadata import SpecDecodeMetadata
from kvserve.sampling_params import _SAMPLING_EPS

# Sampling rows (ascending batch rows) -> their SamplingMetadata; refreshes the processors.
MetadataFactory = Callable[[np.ndarray], SamplingMetadata]


@dataclass
class RejectionSamplerOutput:
    # Per sampling row: the accepted drafts, then the recovered or bonus token.
    sampled_token_ids: list[list[int]]
    # Rows: the emitted tokens of every sampling row in order; None when no row asked.
    logprobs_tensors: LogprobsTensors | None


class RejectionSampler(torch.nn.Module):
    def forward(
        self,
        spec: SpecDecodeMetadata,
        draft_probs: torch.Tensor | None,
        logits: torch.Tensor,
        sample_rows: np.ndarray,
        make_metadata: MetadataFactory,
    ) -> RejectionSamplerOutput:
        """``logits`` [sum(n_i + 1), V] laid out by ``spec``; ``draft_probs`` [same rows
        minus the last of each sampling row, V], or None for one-hot drafts.
        ``sample_rows``: the batch row of each sampling row."""
        logits = logits.to(torch.float32)
        full = make_metadata(sample_rows)
        # Constrained rows arrive masked per position (the scheduler validated their drafts
        # against the grammar): verification only ever sees tokens the grammar allows.
        if (
            full.all_greedy
            and full.no_penalties
            and not _active(full.logitsprocs.non_argmax_invariant)
        ):
            sampled = _verify_plain_greedy(spec, logits)
        else:
            sampled = self._verify(spec, draft_probs, logits, sample_rows, full, make_metadata)
        logprobs = None
        if full.max_num_logprobs is not None:
            flat = np.concatenate(
                [spec.cu_num_logits[i] + np.arange(len(t)) for i, t in enumerate(sampled)]
            )
            tokens = torch.tensor([t for row in sampled for t in row], device=logits.device)
            raw = logits[torch.from_numpy(flat).to(logits.device)].log_softmax(dim=-1)
            logprobs = gather_logprobs(raw, full.max_num_logprobs, tokens)
        return RejectionSamplerOutput(sampled, logprobs)

    def _verify(
        self,
        spec: SpecDecodeMetadata,
        draft_probs: torch.Tensor | None,
        logits: torch.Tensor,
        sample_rows: np.ndarray,
        full: SamplingMetadata,
        make_metadata: MetadataFactory,
    ) -> list[list[int]]:
        drafts = spec.draft_token_ids
        sampled: list[list[int]] = [[] for _ in drafts]
        live = full.output_token_ids
        base_lens = [len(out) for out in live]
        active = np.arange(len(drafts))
        metadata = full
        try:
            for pos in range(spec.max_spec_len + 1):
                if pos:
                    metadata = make_metadata(sample_rows[active])
                rows = spec.cu_num_logits[active] + pos
                greedy, probs = target_distribution(logits[torch.from_numpy(rows)], metadata)
                still: list[int] = []
                for k, i in enumerate(active.tolist()):
                    token, accepted = self._decide(
                        k, pos, drafts[i], greedy, probs, draft_probs, spec, i, metadata
                    )
                    sampled[i].append(token)
                    if accepted and pos + 1 <= len(drafts[i]):
                        live[i].append(token)  # position pos+1 sees it as output
                        still.append(i)
                active = np.array(still, dtype=np.int64)
                if not len(active):
                    break
        finally:
            for out, n in zip(live, base_lens, strict=True):
                del out[n:]
        return sampled

    @staticmethod
    def _decide(
        k: int,
        pos: int,
        draft: list[int],
        greedy: torch.Tensor,
        probs: torch.Tensor | None,
        draft_probs: torch.Tensor | None,
        spec: SpecDecodeMetadata,
        i: int,
        metadata: SamplingMetadata,
    ) -> tuple[int, bool]:
        """(token emitted at this position, whether it is an accepted draft)."""
        is_greedy = probs is None or (
            metadata.temperature is not None and float(metadata.temperature[k]) < _SAMPLING_EPS
        )
        generator = metadata.generators.get(k)
        generators = {0: generator} if generator is not None else {}
        if is_greedy:
            token = int(greedy[k])
            return token, pos < len(draft) and token == draft[pos]
        assert probs is not None
        p = probs[k]
        if draft_probs is None or pos == len(draft):
            # One-hot drafts (and the bonus token): the token is p's sample from the row's
            # next draw, and the draft is accepted when it is that token. Acceptance is
            # p(d) and a rejection yields p without d, as the general rule gives, but every
            # emitted token costs one draw, as in plain decoding: a seeded request gets the
            # same tokens however many drafts the scheduler let it verify each step, and
            # the same as without speculation.
            token = int(random_sample(p.unsqueeze(0).clone(), generators)[0])
            return token, pos < len(draft) and token == draft[pos]
        token = draft[pos]
        # draft_probs rows skip each sampling row's bonus position.
        q = draft_probs[int(spec.cu_num_logits[i]) - i + pos]
        u = torch.rand(1, generator=generator, device=p.device)
        if float(u) * float(q[token]) <= float(p[token]) and float(p[token]) > 0:
            return token, True
        residual = (p - q).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:
            residual = p.clone()  # p == q: rejection has probability 0; guard rounding
        return int(random_sample(residual.unsqueeze(0), generators)[0]), False


def _verify_plain_greedy(spec: SpecDecodeMetadata, logits: torch.Tensor) -> list[list[int]]:
    """All rows greedy and nothing rewrites the logits: one argmax over every position."""
    target = greedy_tokens(logits).tolist()
    sampled: list[list[int]] = []
    for i, draft in enumerate(spec.draft_token_ids):
        start = int(spec.cu_num_logits[i])
        row = [target[start]]
        for pos, token in enumerate(draft):
            if token != row[-1]:
                break
            row.append(target[start + pos + 1])
        sampled.append(row)
    return sampled


def target_distribution(
    logits: torch.Tensor, metadata: SamplingMetadata
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The Sampler's processing of logits [N, V] without the final draw: (argmax after the
    processors and penalties, for greedy rows; the probabilities random rows sample from,
    None when every row is greedy). Same order as Sampler.forward and Sampler.sample."""
    logits = _apply_processors(
        logits.clone(), metadata, _active(metadata.logitsprocs.non_argmax_invariant)
    )
    logits = apply_metadata_penalties(logits, metadata)
    greedy = greedy_tokens(logits)
    if metadata.all_greedy:
        return greedy, None
    assert metadata.temperature is not None
    temperature = torch.where(metadata.temperature < _SAMPLING_EPS, 1.0, metadata.temperature)
    logits.div_(temperature.unsqueeze(1).to(logits.dtype))
    logits = _apply_processors(logits, metadata, _active(metadata.logitsprocs.argmax_invariant))
    logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
    return greedy, _softmax_of_defined(logits)
