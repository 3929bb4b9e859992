"""The models this server answers for: `/v1/models` and the `model` field of every request.

The base model is always served; with LoRA on, each adapter (``--lora-modules`` at start,
``/v1/load_lora_adapter`` later) is a model of its own name, whose requests run through
that adapter.
"""

from __future__ import annotations

import itertools
import time

from kvserve.config import LoRAConfig, ModelConfig
from kvserve.entrypoints.openai.protocol import ModelCard, ModelList, OpenAIServingError
from kvserve.lora.peft_config import read_peft_config
from kvserve.lora.request import LoRARequest


class OpenAIServingModels:
    def __init__(
        self,
        model_config: ModelConfig,
        lora_config: LoRAConfig | None = None,
        lora_modules: dict[str, str] | None = None,
    ) -> None:
        assert model_config.served_model_name is not None
        self.model_name: str = model_config.served_model_name
        self.root = model_config.model or self.model_name
        self.max_model_len = model_config.max_model_len
        self.created = int(time.time())
        self.lora_config = lora_config
        self.lora_requests: dict[str, LoRARequest] = {}
        # Ids are never reused: a worker may still hold an unloaded adapter's weights.
        self._lora_ids = itertools.count(1)
        for name, path in (lora_modules or {}).items():
            self.load_lora_adapter(name, path)

    def resolve(self, requested: str | None) -> str:
        """The served name for ``requested``; raises a 404 OpenAIServingError for another model."""
        if requested is None or requested == "" or requested == self.model_name:
            return self.model_name
        if requested in self.lora_requests:
            return requested
        raise OpenAIServingError(
            f"The model `{requested}` does not exist.", status=404, param="model"
        )

    def lora_request(self, requested: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model)."""
        return self.lora_requests.get(requested) if requested else None

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> LoRARequest:
        """Registers an adapter; raises a 400 OpenAIServingError if it cannot be served."""
        if self.lora_config is None:
            raise OpenAIServingError(
                "LoRA is not enabled: start the server with --enable-lora", param="lora_name"
            )
        if not lora_name or not lora_path:
            raise OpenAIServingError("lora_name and lora_path are both required")
        if lora_name in self.lora_requests or lora_name == self.model_name:
            raise OpenAIServingError(
                f"The lora adapter '{lora_name}' has already been loaded.", param="lora_name"
            )
        try:
            read_peft_config(lora_path, self.lora_config.max_lora_rank)
        except ValueError as exc:
            raise OpenAIServingError(str(exc), param="lora_path") from None
        request = LoRARequest(lora_name, next(self._lora_ids), lora_path)
        self.lora_requests[lora_name] = request
        return request

    def unload_lora_adapter(self, lora_name: str) -> None:
        if self.lora_requests.pop(lora_name, None) is None:
            raise OpenAIServingError(
                f"The lora adapter '{lora_name}' cannot be found.", status=404, param="lora_name"
            )

    def show_available_models(self) -> ModelList:
        cards = [
            ModelCard(
                id=self.model_name,
                root=self.root,
                created=self.created,
                max_model_len=self.max_model_len,
            )
        ]
        cards += [
            ModelCard(
                id=lora.lora_name,
                root=lora.lora_path,
                parent=self.model_name,
                created=self.created,
                max_model_len=self.max_model_len,
            )
            for lora in self.lora_requests.values()
        ]
        return ModelList(data=cards)
