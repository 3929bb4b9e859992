"""A draft model: a second, smaller or cheaper model with the target's tokenizer drafts
greedily, k tokens a step, run by the same worker.

Its attention layers join the KV cache config under a ``draft.`` prefix, so its paged KV
cache lives in the same blocks as the target's (one block id, both models' layers) and it
reuses the target's block tables, prefix caching and preemption. The special case that
matters most is the target's own file under a lossy, faster quantization (``gguf_int8``).

Per request the proposer remembers how many leading positions hold its own KV for the
request's true tokens. Each step it first catches up over the tokens it has not seen (the
prompt on the first step; afterwards the accepted drafts' successor and at most one more),
which also yields its first draft, then feeds each draft back for the next, writing KV at
positions past the verified tokens: the scheduler's lookahead slots hold them, and the
next step overwrites whatever the target rejected.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvserve import _custom_ops as ops
from kvserve.attention.backends.utils import CommonAttentionMetadata
from kvserve.attention.layer import Attention, bind_kv_cache, get_attention_layers
from kvserve.forward_context import set_forward_context
from kvserve.model_executor.model_loader import get_model
from kvserve.spec_decode.proposer import Proposer, ProposerInputs

if TYPE_CHECKING:
    from kvserve.config import EngineConfig

DRAFT_PREFIX = "draft."
# Catch-ups up to this many tokens per request run as one-token (decode) queries.
_MAX_SPLIT_QUERY_LEN = 8


class DraftModelProposer(Proposer):
    method = "draft_model"

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        super().__init__(config, device)
        spec = config.speculative_config
        assert spec is not None and spec.draft_model_config is not None
        self.model_config = spec.draft_model_config
        self.max_model_len = config.max_seq_len
        self.model: Any = None
        self.attn_builders: list[Any] = []
        self.layer_to_group: dict[str, int] = {}
        # req_id -> leading positions whose draft KV holds the request's true tokens.
        self.num_draft_computed: dict[str, int] = {}

    def load_model(self) -> None:
        mc = self.model_config
        quantization = mc.quantization
        if mc.quantization_is_default and (self.device.type != "cpu" or not ops.available()):
            quantization = None  # as the target: GGUF blocks need the CPU kernels
        self.model = get_model(mc.resolved, mc.arch, self.device, torch.float32, quantization)
        for name, layer in get_attention_layers(self.model).items():
            layer.layer_name = DRAFT_PREFIX + name

    def attention_layers(self) -> dict[str, Attention]:
        if self.model is None:
            raise RuntimeError("load_model() must run first")
        return get_attention_layers(self.model)

    def bind_kv_cache(
        self,
        kv_caches: dict[str, torch.Tensor],
        attn_builders: list[Any],
        layer_to_group: dict[str, int],
    ) -> None:
        bind_kv_cache(self.model, kv_caches)
        self.attn_builders = attn_builders
        self.layer_to_group = {
            name: g for name, g in layer_to_group.items() if name.startswith(DRAFT_PREFIX)
        }

    def remove_requests(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self.num_draft_computed.pop(req_id, None)

    def request_census(self) -> dict[str, int]:
        return {"num_draft_computed": len(self.num_draft_computed)}

    @torch.inference_mode()
    def propose(self, inputs: ProposerInputs) -> list[list[int]]:
        table = inputs.block_table
        block_size = table[0].block_size
        rows = inputs.rows
        num_tokens = inputs.num_tokens[rows].astype(np.int64)
        # KV written before this step may be stale past the scheduler's computed count
        # (rejected drafts, preemption); a request never seen starts from scratch.
        start = np.array(
            [
                min(self.num_draft_computed.get(req_id, 0), int(inputs.num_computed_before[row]))
                for req_id, row in zip(inputs.req_ids, rows.tolist(), strict=True)
            ],
            dtype=np.int64,
        )
        # Drafts stay within the row's allocated slots and the context.
        capacity = table[0].num_blocks_per_row[rows].astype(np.int64) * block_size
        num_drafts = np.minimum(
            self.num_speculative_tokens,
            np.minimum(capacity - num_tokens + 1, self.max_model_len - num_tokens),
        ).clip(min=0)
        drafts: list[list[int]] = [[] for _ in range(len(rows))]
        active = np.flatnonzero(num_drafts > 0)
        for i in active.tolist():
            self.num_draft_computed[inputs.req_ids[i]] = int(num_tokens[i])
        fed: np.ndarray | None = None
        for round_index in range(int(num_drafts.max(initial=0))):
            keep = num_drafts[active] > round_index
            active = active[keep]
            if not len(active):
                break
            if round_index == 0:
                # Catch up over the known tokens without draft KV; yields the first draft.
                starts, ends = start[active], num_tokens[active]
            else:
                # Draft r-1 goes in at its position (past the verified tokens).
                assert fed is not None
                fed = fed[keep]
                starts = num_tokens[active] + round_index - 1
                ends = starts + 1
            fed = self._step(inputs, rows[active], starts, ends, fed)
            for i, token in zip(active.tolist(), fed.tolist(), strict=True):
                drafts[i].append(token)
        return drafts

    def _step(
        self,
        inputs: ProposerInputs,
        rows: np.ndarray,
        starts: np.ndarray,
        ends: np.ndarray,
        fed_tokens: np.ndarray | None,
    ) -> np.ndarray:
        """One forward of the draft model over positions [starts, ends) of each row; the
        tokens are the batch's known ones, or ``fed_tokens`` (one per row, the drafts).
        Returns the greedy next token of each row."""
        lens = ends - starts
        owner = np.repeat(np.arange(len(rows)), lens)
        cu = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        positions = starts[owner] + np.arange(int(cu[-1])) - cu[owner]
        if fed_tokens is None:
            token_ids = inputs.token_ids[rows[owner], positions].astype(np.int64)
        else:
            token_ids = fed_tokens.astype(np.int64)
        # Short catch-ups run as one-token queries (the same causal mask), so the step
        # stays a decode step for the fused decode kernels; long ones (a prompt) as chunks.
        if int(lens.max()) <= _MAX_SPLIT_QUERY_LEN:
            q_rows, q_starts, q_ends = rows[owner], positions, positions + 1
            q_cu = np.arange(len(positions) + 1, dtype=np.int64)
        else:
            q_rows, q_starts, q_ends, q_cu = rows, starts, ends, cu
        metadata: dict[str, Any] | Any = {}
        per_group = []
        for group, builder in enumerate(self.attn_builders):
            table = inputs.block_table[group]
            bs = table.block_size
            blocks = table.block_table_np[rows[owner], positions // bs].astype(np.int64)
            common = CommonAttentionMetadata(
                query_start_loc=torch.from_numpy(q_cu.astype(np.int32)).to(self.device),
                query_start_loc_cpu=torch.from_numpy(q_cu.astype(np.int32)),
                seq_lens=torch.from_numpy(q_ends.astype(np.int32)).to(self.device),
                seq_lens_cpu=torch.from_numpy(q_ends.astype(np.int32)),
                num_computed_tokens_cpu=torch.from_numpy(q_starts.astype(np.int32)),
                num_reqs=len(q_rows),
                num_actual_tokens=int(cu[-1]),
                max_query_len=int((q_ends - q_starts).max()),
                max_seq_len=int(q_ends.max()),
                block_table_tensor=table.block_table_cpu[torch.from_numpy(q_rows)].to(self.device),
                slot_mapping=torch.from_numpy(blocks * bs + positions % bs).to(self.device),
            )
            per_group.append(builder.build(common))
        if len(per_group) == 1:
            metadata = per_group[0]
        else:
            metadata = {name: per_group[g] for name, g in self.layer_to_group.items()}
        with set_forward_context(metadata):
            hidden = self.model(
                torch.from_numpy(token_ids).to(self.device),
                torch.from_numpy(positions).to(self.device),
            )
        logits = self.model.compute_logits(hidden[torch.from_numpy(cu[1:] - 1).to(self.device)])
        return logits.argmax(dim=-1).cpu().numpy()
