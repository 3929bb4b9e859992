"""LoRAModelManager: wraps a model's attention and MLP projections with ``LoRALinear``,
keeps up to ``max_loras`` PEFT adapters resident in slots, and tells the layers, each
step, which slot each token runs through.

Adapters load from their PEFT directory the first time a step needs them; when all slots
are taken, the least recently used adapter that this step does not need makes room (the
scheduler never puts more than ``max_loras`` adapters in one step).
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from kvserve.config import LoRAConfig
from kvserve.lora.peft_config import ADAPTER_WEIGHTS, read_peft_config
from kvserve.lora.request import LoRARequest
from kvserve.model_executor.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
)
from kvserve.model_executor.lora.layers import LoRALinear, LoRAStepState

logger = logging.getLogger(__name__)

# The projections adapters apply to: attention (fused q/k/v, output) and MLP.
LORA_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_QKV_SHARDS = {"q": 0, "k": 1, "v": 2}
# base_model.model.<module>.lora_A.weight (older PEFT: lora_A.<adapter name>.weight).
_PEFT_TENSOR = re.compile(
    r"^base_model\.model\.(?P<module>.+)\.lora_(?P<kind>[AB])(\.\w+)?\.weight$"
)


def _output_slices(layer: LinearBase) -> list[int]:
    if isinstance(layer, QKVParallelLinear):
        return [layer.q_size, layer.kv_size, layer.kv_size]
    if isinstance(layer, MergedColumnParallelLinear):
        return [size // layer.tp_size for size in layer.output_sizes]
    return [int(getattr(layer, "output_size_per_partition", layer.output_size))]


class LoRAModelManager:
    def __init__(self, model: nn.Module, config: LoRAConfig) -> None:
        self.config = config
        self.state = LoRAStepState()
        self.layers: dict[str, LoRALinear] = {}
        # checkpoint sub-name (".q_proj.") -> (fused sub-name, shard), as the model loads.
        self.stacked_params: Mapping[str, tuple[str, str | int]] = getattr(
            model, "stacked_params", {}
        )
        self._wrap(model)
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no projections LoRA can apply to")
        # lora_int_id -> slot, least recently used first.
        self.slots: OrderedDict[int, int] = OrderedDict()
        self.device: torch.device = next(iter(self.layers.values())).lora_a.device

    def _wrap(self, model: nn.Module) -> None:
        for name, module in list(model.named_modules()):
            if not isinstance(module, LinearBase) or name.rsplit(".", 1)[-1] not in LORA_TARGETS:
                continue
            parent_name, _, child = name.rpartition(".")
            wrapped = LoRALinear(
                module,
                _output_slices(module),
                self.config.max_loras,
                self.config.max_lora_rank,
                self.state,
            )
            setattr(model.get_submodule(parent_name), child, wrapped)
            self.layers[name] = wrapped
        # Fused native paths (the C++ decode stack) read the base weights directly and
        # would skip the adapters: the modules run every step instead.
        for module in model.modules():
            if hasattr(module, "decode_stack"):
                setattr(module, "decode_stack", None)  # noqa: B010

    # ---- per step ----------------------------------------------------------------------

    def set_active_loras(
        self, row_loras: Sequence[LoRARequest | None], num_scheduled_tokens: np.ndarray
    ) -> None:
        """Rows' adapters (None: the base model) and their tokens this step, in batch order."""
        if all(lora is None for lora in row_loras):
            self.state.token_mask = None
            return
        needed = {lora.lora_int_id for lora in row_loras if lora is not None}
        if len(needed) > self.config.max_loras:
            raise RuntimeError(
                f"a step uses {len(needed)} LoRA adapters, more than max_loras="
                f"{self.config.max_loras} (the scheduler should have kept them apart)"
            )
        row_slots = np.array(
            [-1 if lora is None else self._slot_for(lora, needed) for lora in row_loras],
            dtype=np.int64,
        )
        token_slots = torch.from_numpy(np.repeat(row_slots, num_scheduled_tokens)).to(self.device)
        mask = torch.zeros(len(token_slots), self.config.max_loras + 1, device=self.device)
        # Slot -1 (the base model) lands in the extra last column, dropped here.
        mask[torch.arange(len(token_slots), device=self.device), token_slots] = 1.0
        self.state.token_mask = mask[:, : self.config.max_loras]

    def _slot_for(self, lora: LoRARequest, needed: set[int]) -> int:
        slot = self.slots.get(lora.lora_int_id)
        if slot is not None:
            self.slots.move_to_end(lora.lora_int_id)
            return slot
        if len(self.slots) < self.config.max_loras:
            slot = len(self.slots)
        else:
            victim = next(i for i in self.slots if i not in needed)
            slot = self.slots.pop(victim)
        self._load(slot, lora)
        self.slots[lora.lora_int_id] = slot
        return slot

    # ---- loading -----------------------------------------------------------------------

    def _load(self, slot: int, lora: LoRARequest) -> None:
        peft = read_peft_config(lora.lora_path, self.config.max_lora_rank)
        tensors = load_file(str(Path(lora.lora_path) / ADAPTER_WEIGHTS), device="cpu")
        for layer in self.layers.values():
            layer.reset_slot(slot)
        try:
            for name, tensor in tensors.items():
                layer_name, sub, kind = self._target(name)
                layer = self.layers[layer_name]
                if kind == "A":
                    layer.set_lora(slot, sub, lora_a=tensor.float())
                else:
                    layer.set_lora(slot, sub, lora_b=tensor.float(), scaling=peft.scaling)
        except Exception:
            for layer in self.layers.values():
                layer.reset_slot(slot)  # never leave half an adapter in the slot
            raise
        logger.info(
            "LoRA adapter %r (id %d, rank %d) loaded into slot %d",
            lora.lora_name, lora.lora_int_id, peft.rank, slot,
        )  # fmt: skip

    def _target(self, tensor_name: str) -> tuple[str, int, str]:
        """(wrapped layer name, sub-projection, "A"/"B") of a PEFT tensor name."""
        match = _PEFT_TENSOR.match(tensor_name)
        if match is None:
            raise ValueError(f"unsupported tensor {tensor_name!r} in a LoRA adapter")
        module, kind = match["module"] + ".", match["kind"]
        sub = 0
        for ckpt_part, (fused_part, shard) in self.stacked_params.items():
            if ckpt_part in module:
                module = module.replace(ckpt_part, fused_part)
                sub = _QKV_SHARDS[shard] if isinstance(shard, str) else shard
                break
        layer_name = module.removesuffix(".")
        if layer_name not in self.layers:
            raise ValueError(f"LoRA tensor {tensor_name!r} targets no supported projection")
        return layer_name, sub, kind
