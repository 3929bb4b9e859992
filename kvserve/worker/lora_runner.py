"""vLLM's LoRAModelRunnerMixin as a component: tells the wrapped projections which adapter
each row's tokens use this step. ``LoRARunner`` is the no-op form without enable_lora."""

from __future__ import annotations

import numpy as np

from kvserve.model_executor.lora.model_manager import LoRAModelManager
from kvserve.worker.input_batch import InputBatch


class LoRARunner:
    """Without enable_lora: every row runs the base model."""

    def set_active_loras(self, batch: InputBatch, num_scheduled_tokens: np.ndarray) -> None:
        pass


class ActiveLoRARunner(LoRARunner):
    """Holds the adapters' slots and the wrapped projections (built after load_model)."""

    def __init__(self, manager: LoRAModelManager) -> None:
        self.manager = manager

    def set_active_loras(self, batch: InputBatch, num_scheduled_tokens: np.ndarray) -> None:
        rows = batch.requests[: batch.num_reqs]
        self.manager.set_active_loras(
            [None if r is None else r.lora_request for r in rows], num_scheduled_tokens
        )
