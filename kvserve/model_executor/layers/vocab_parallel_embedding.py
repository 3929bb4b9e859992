"""Token embedding and LM head with the vocabulary split across TP ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.distributed.parallel_state import get_pp_group, get_tp_group
from kvserve.model_executor.layers.linear import ShardRange, get_tp_rank_size

if TYPE_CHECKING:
    from kvserve.model_executor.layers.block_weight import BlockWeight
    from kvserve.model_executor.layers.greedy_screen import GreedyScreen


class VocabParallelEmbedding(nn.Module):
    """Each rank holds rows ``[vocab_start, vocab_end)``; the table is padded so
    every rank holds the same number of rows (padding rows stay zero)."""

    # Set by the quantization loader (attach_gguf_blocks, or quantize_model's lossless
    # path) for an embedding tied to a GGUF LM head: this rank's rows of the table as the
    # head's own blocks (padding rows zero blocks), each lookup dequantizing only its
    # rows, so no float32 table is kept.
    row_blocks: BlockWeight | None = None

    def __init__(self, num_embeddings: int, embedding_dim: int, prefix: str = "") -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.prefix = prefix
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def shard_range(self, param_dim: int = 2, shard_id: object = None) -> ShardRange:
        """This rank's rows of the full table (fewer than the partition on the last
        rank when the vocabulary does not divide: the rest is zero padding)."""
        return 0, self.vocab_start, self.vocab_end - self.vocab_start

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[1] != self.embedding_dim or loaded.shape[0] != self.num_embeddings:
            raise ValueError(
                f"{self.prefix}: checkpoint shape {tuple(loaded.shape)} != "
                f"({self.num_embeddings}, {self.embedding_dim})"
            )
        rows = self.vocab_end - self.vocab_start
        with torch.no_grad():
            param[:rows].copy_(loaded[self.vocab_start : self.vocab_end])
            param[rows:].zero_()

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.row_blocks is not None:
            rows = self.row_blocks.dequantize_rows(ids)
            return rows if rows.dtype == self.weight.dtype else rows.to(self.weight.dtype)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._rows(input_ids)
        local = input_ids - self.vocab_start
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        out = self._rows(local.masked_fill(outside, 0))
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        # Exactly one rank holds each token's row: the sum is that row.
        return get_tp_group().all_reduce(out)

    def extra_repr(self) -> str:
        return f"vocab={self.num_embeddings}, dim={self.embedding_dim}, tp={self.tp_rank}/{self.tp_size}"


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection onto the vocabulary; may share its weight with the embedding."""

    # Set by quantize_model (--quantization): the projection as GGUF blocks.
    quant_weight: BlockWeight | None = None
    # With lossless blocks and one TP rank: greedy tokens without every exact logit.
    greedy_screen: GreedyScreen | None = None

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> None:
        self.weight = embed_tokens.weight

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden] -> [N, vocab]`` float32 logits."""
        if not get_pp_group().is_last_rank:
            # Only the last pipeline stage has the final hidden states; it samples and the
            # scheduler sends the tokens to the others, which never wait for it (so they
            # can run the next micro-batch meanwhile).
            raise RuntimeError("compute_logits() runs on the last pipeline stage only")
        return self._logits(hidden_states)

    def greedy_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """int64 ``[N]``: ``compute_logits(hidden_states).argmax(-1)`` exactly (the first
        of equal maxima), cheaper where the greedy screen applies; None where it does not
        (the caller computes the logits)."""
        screen = self.greedy_screen
        if screen is None:
            return None
        if hidden_states.dtype != torch.float32:
            hidden_states = hidden_states.float()
        return screen.greedy_tokens(hidden_states)

    def _logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # Conversions and slices that would change nothing are skipped: each is a trip
        # through torch's dispatcher in every decode step.
        if self.quant_weight is not None:
            if hidden_states.dtype != torch.float32:
                hidden_states = hidden_states.float()
            logits = self.quant_weight.linear(hidden_states)
        else:
            logits = F.linear(hidden_states, self.weight)
            if logits.dtype != torch.float32:
                logits = logits.float()
        if self.tp_size > 1:
            # Every rank samples from the whole row, so each keeps the same batch state.
            logits = get_tp_group().all_gather(logits, dim=-1)
        if logits.shape[-1] == self.num_embeddings:
            return logits
        return logits[..., : self.num_embeddings]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not an embedding; call compute_logits()")
