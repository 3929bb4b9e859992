"""Raw logprobs in vLLM's [chosen token, top-1..top-k] layout, with the chosen token's rank."""

from __future__ import annotations

import torch

from kvserve.protocol.runner_output import LogprobsTensors


def gather_logprobs(
    logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor
) -> LogprobsTensors:
    """logprobs [N, V]; token_ids [N] -> columns [token, top-1..top-num_logprobs] and the
    token's rank (1 + number of tokens with a strictly larger logprob)."""
    token_ids = token_ids.to(torch.int64).unsqueeze(-1)
    token_logprobs = logprobs.gather(-1, token_ids)
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    if num_logprobs > 0:
        top_logprobs, top_ids = logprobs.topk(min(num_logprobs, logprobs.shape[-1]), dim=-1)
        token_ids = torch.cat((token_ids, top_ids), dim=1)
        token_logprobs = torch.cat((token_logprobs, top_logprobs), dim=1)
    return LogprobsTensors(token_ids, token_logprobs, ranks)


def compute_prompt_logprobs(
    logits: torch.Tensor, target_token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Prompt logprobs from the raw logits [P, V] of positions whose next prompt token is
    target_token_ids [P]; num_logprobs -1 means the whole vocabulary."""
    logprobs = logits.to(torch.float32).log_softmax(dim=-1)
    k = logits.shape[-1] if num_logprobs == -1 else num_logprobs
    return gather_logprobs(logprobs, k, target_token_ids.to(logits.device))
