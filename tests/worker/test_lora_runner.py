"""The LoRA component hands the manager each row's adapter in batch order (a fake
manager, no model); the no-op form touches nothing."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvserve.lora.request import LoRARequest
from kvserve.sample.sampling_batch import SamplingBatch
from kvserve.sampling_params import SamplingParams
from kvserve.worker.input_batch import InputBatch
from kvserve.worker.lora_runner import ActiveLoRARunner, LoRARunner
from kvserve.worker.request_state import CachedRequestState

CPU = torch.device("cpu")


class RecordingManager:
    def __init__(self) -> None:
        self.calls: list[tuple[list[LoRARequest | None], list[int]]] = []

    def set_active_loras(
        self, row_loras: Sequence[LoRARequest | None], num_scheduled_tokens: np.ndarray
    ) -> None:
        self.calls.append((list(row_loras), num_scheduled_tokens.tolist()))


def _batch(adapter: LoRARequest) -> InputBatch:
    batch = InputBatch(4, 16, 32, CPU, [4], SamplingBatch(4, 64, CPU))
    for i, lora in enumerate((None, adapter)):
        state = CachedRequestState(f"r{i}", [3, 4], SamplingParams(), None, ([1 + i],), 0)
        state.lora_request = lora
        batch.add_request(state)
    return batch


def test_rows_adapters_in_batch_order() -> None:
    adapter = LoRARequest("a", 1, "/nowhere")
    manager = RecordingManager()
    ActiveLoRARunner(manager).set_active_loras(_batch(adapter), np.array([2, 1]))  # type: ignore[arg-type]
    assert manager.calls == [([None, adapter], [2, 1])]


def test_no_op_form() -> None:
    LoRARunner().set_active_loras(_batch(LoRARequest("a", 1, "/nowhere")), np.array([2, 1]))
