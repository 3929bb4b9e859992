"""LoRARequest: which adapter a request runs with (vLLM's fields and names)."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """A PEFT-format adapter directory (``adapter_config.json`` and
    ``adapter_model.safetensors``) under a user-facing name.

    ``lora_int_id`` (>= 1) identifies the adapter everywhere inside the engine: the
    worker's adapter slots and the prefix cache's block hashes key on it, so two
    requests with different adapters never share KV blocks.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
