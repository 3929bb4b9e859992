"""The models this server answers for: `/v1/models` and the `model` field of every request."""

from __future__ import annotations

import time

from kvserve.config import ModelConfig
from kvserve.entrypoints.openai.protocol import ModelCard, ModelList, OpenAIServingError


class OpenAIServingModels:
    """One engine, one model: requests name it by its served name (or leave `model` out)."""

    def __init__(self, model_config: ModelConfig) -> None:
        assert model_config.served_model_name is not None
        self.model_name: str = model_config.served_model_name
        self.root = model_config.model or self.model_name
        self.max_model_len = model_config.max_model_len
        self.created = int(time.time())

    def resolve(self, requested: str | None) -> str:
        """The served name for ``requested``; raises a 404 OpenAIServingError for another model."""
        if requested is None or requested == "" or requested == self.model_name:
            return self.model_name
        raise OpenAIServingError(
            f"The model `{requested}` does not exist.", status=404, param="model"
        )

    def show_available_models(self) -> ModelList:
        card = ModelCard(
            id=self.model_name,
            root=self.root,
            created=self.created,
            max_model_len=self.max_model_len,
        )
        return ModelList(data=[card])
