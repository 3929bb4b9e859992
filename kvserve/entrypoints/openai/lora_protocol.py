"""Bodies of vLLM's dynamic LoRA endpoints (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`)."""

from __future__ import annotations

from kvserve.entrypoints.openai.protocol import OpenAIRequestModel, ShortString


class LoadLoRAAdapterRequest(OpenAIRequestModel):
    lora_name: ShortString
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIRequestModel):
    lora_name: ShortString
    # vLLM accepts the id too; names are what this server keys adapters by.
    lora_int_id: int | None = None
