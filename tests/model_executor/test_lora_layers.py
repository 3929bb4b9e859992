"""LoRALinear: rows of one batch through different adapters equal each row through its
own merged weight ``W + scaling * B @ A``; empty slots and the base rows are untouched."""

from __future__ import annotations

import pytest
import torch

from kvserve.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from kvserve.model_executor.lora.layers import LoRALinear, LoRAStepState


def _mask(slots: list[int], max_loras: int) -> torch.Tensor:
    mask = torch.zeros(len(slots), max_loras)
    for t, slot in enumerate(slots):
        if slot >= 0:
            mask[t, slot] = 1.0
    return mask


def test_mixed_rows_equal_merged_weights() -> None:
    torch.manual_seed(0)
    base = MergedColumnParallelLinear(16, [8, 12], bias=False)
    torch.nn.init.normal_(base.weight)
    state = LoRAStepState()
    layer = LoRALinear(base, [8, 12], max_loras=3, max_rank=4, state=state)
    adapters = {}  # slot -> per-sub (A, B, scaling)
    for slot, rank in ((0, 4), (2, 2)):  # slot 1 stays empty; rank 2 is zero-padded
        subs = []
        for sub, size in enumerate((8, 12)):
            a, b = torch.randn(rank, 16), torch.randn(size, rank)
            layer.set_lora(slot, sub, lora_a=a, lora_b=b, scaling=0.5)
            subs.append((a, b))
        adapters[slot] = subs
    x = torch.randn(6, 16)
    slots = [0, -1, 2, 2, 1, 0]
    state.token_mask = _mask(slots, 3)
    out = layer(x)
    for t, slot in enumerate(slots):
        weight = base.weight.clone()
        if slot in adapters:
            delta = torch.cat([b @ a for a, b in adapters[slot]]) * 0.5
            weight += delta
        torch.testing.assert_close(out[t], x[t] @ weight.T, atol=1e-4, rtol=1e-4)
    state.token_mask = None  # no adapter in the step: the base layer alone
    torch.testing.assert_close(layer(x), base(x))


def test_reset_slot_and_rank_checks() -> None:
    base = RowParallelLinear(8, 8, bias=True)
    torch.nn.init.normal_(base.weight)
    torch.nn.init.normal_(base.bias)
    state = LoRAStepState()
    layer = LoRALinear(base, [8], max_loras=1, max_rank=2, state=state)
    layer.set_lora(0, 0, lora_a=torch.randn(2, 8), lora_b=torch.randn(8, 2))
    x = torch.randn(3, 8)
    state.token_mask = _mask([0, 0, 0], 1)
    assert not torch.allclose(layer(x), base(x))
    layer.reset_slot(0)
    torch.testing.assert_close(layer(x), base(x))
    with pytest.raises(ValueError, match="max_lora_rank"):
        layer.set_lora(0, 0, lora_a=torch.randn(4, 8))
    with pytest.raises(ValueError, match="input size"):
        layer.set_lora(0, 0, lora_a=torch.randn(2, 9))
