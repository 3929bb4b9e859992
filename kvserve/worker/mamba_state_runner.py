"""The model runner's component that keeps Mamba states exact under speculative
decoding.

A step that verifies drafts runs each row with drafts through its Mamba layers token by
token, keeping the state after every position (MambaMixer2._run_keeping_states). The
state written back is the one after the last draft; once the rejection sampler has
decided, this component puts back, for every row that lost drafts, the state after its
last accepted token, so the request's state always matches its computed tokens.
Preemption needs nothing here: a preempted request's block is freed and it recomputes
from zeros (``has_initial_state`` is false at ``num_computed_tokens == 0``).

``MambaStateRunner`` is the no-op form (no Mamba layers); ``ActiveMambaStateRunner``
does the work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvserve.model_executor.layers.mamba.mamba_metadata import MambaMetadata

if TYPE_CHECKING:
    from kvserve.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
    from kvserve.protocol.scheduler_output import SchedulerOutput
    from kvserve.worker.input_batch import InputBatch


class MambaStateRunner:
    def prepare(
        self, attn_metadata: Any, batch: InputBatch, scheduler_output: SchedulerOutput
    ) -> None:
        """Marks the step's rows with drafts (before the forward)."""

    def commit(self, sampled_token_ids: list[list[int]]) -> None:
        """Puts back the states after the accepted tokens (after sampling)."""


class ActiveMambaStateRunner(MambaStateRunner):
    def __init__(self, layers: dict[str, MambaMixer2]) -> None:
        self.layers = layers
        self.pending: list[MambaMetadata] = []

    def prepare(
        self, attn_metadata: Any, batch: InputBatch, scheduler_output: SchedulerOutput
    ) -> None:
        self.pending = []
        drafts = scheduler_output.scheduled_spec_decode_tokens
        if not drafts:
            return
        rows = {batch.req_id_to_index[req_id] for req_id, draft in drafts.items() if draft}
        by_id: dict[int, MambaMetadata] = {}
        for name in self.layers:
            metadata = attn_metadata[name] if isinstance(attn_metadata, dict) else attn_metadata
            assert isinstance(metadata, MambaMetadata)
            by_id[id(metadata)] = metadata
        for metadata in by_id.values():
            metadata.keep_position_states = rows
        self.pending = list(by_id.values())

    def commit(self, sampled_token_ids: list[list[int]]) -> None:
        pending, self.pending = self.pending, []
        for metadata in pending:
            for layer_name, per_row in metadata.position_states.items():
                layer = self.layers[layer_name]
                for row, (conv_states, ssm_states) in per_row.items():
                    # Tokens kept from the row's input: the last sampled one plus the
                    # accepted drafts, i.e. one per token sampled now.
                    num_kept = len(sampled_token_ids[row])
                    if num_kept == conv_states.shape[0]:
                        continue  # every draft accepted: the written state is right
                    assert num_kept > 0, f"row {row} verified drafts but sampled nothing"
                    block_id = metadata.position_block_ids[row][num_kept - 1]
                    layer.write_state(block_id, conv_states[num_kept - 1], ssm_states[num_kept - 1])


def make_mamba_state_runner(layers: dict[str, MambaMixer2]) -> MambaStateRunner:
    return ActiveMambaStateRunner(layers) if layers else MambaStateRunner()
