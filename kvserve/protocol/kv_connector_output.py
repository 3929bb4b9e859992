"""What a KV connector's worker side sends back each step (on ModelRunnerOutput).

Apart from runner_output so that the scheduler side of a connector, which runs in the
engine core without torch, can import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVConnectorOutput:
    """What a KV connector's worker side reports after a step."""

    # Requests whose asynchronous save finished: the scheduler may free their blocks now.
    finished_sending: set[str] | None = None
    # Requests whose asynchronous load finished: they may leave WAITING_FOR_REMOTE_KVS.
    finished_recving: set[str] | None = None
    # Blocks whose external load failed: their content is garbage and must be recomputed.
    invalid_block_ids: set[int] = field(default_factory=set)

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids)
