"""The front end's multimodal step: a prompt with ``multi_modal_data`` -> token ids with the
placeholders expanded and one MultiModalFeatureSpec per item, checked against the
engine's limits, and (``commit``) the processor cache's say on which items travel as
their hash alone."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvserve.config import ModelConfig, MultiModalConfig, SchedulerConfig
from kvserve.multimodal.media import MediaPolicy
from kvserve.multimodal.processing import MultiModalProcessor, create_processor
from kvserve.multimodal.processor_cache import ProcessorCache
from kvserve.protocol.mm_inputs import MultiModalFeatureSpec


class MultiModalInputs:
    def __init__(
        self,
        model_config: ModelConfig,
        mm_config: MultiModalConfig,
        scheduler_config: SchedulerConfig | None,
    ) -> None:
        self.model_config = model_config
        self.mm_config = mm_config
        self.arch = model_config.arch.multimodal
        self.max_num_batched_tokens = (
            scheduler_config.max_num_batched_tokens if scheduler_config else None
        )
        self.policy = MediaPolicy(
            max_image_pixels=mm_config.max_image_pixels,
            allowed_local_media_path=mm_config.allowed_local_media_path,
            allow_remote_media=mm_config.allow_remote_media,
        )
        self.cache = ProcessorCache(mm_config.processor_cache_bytes)
        self._processor: MultiModalProcessor | None = None

    @property
    def processor(self) -> MultiModalProcessor:
        # Built on first use: transformers' processor loads with the first image.
        if self._processor is None:
            self._processor = create_processor(
                self.model_config.arch.architecture,
                self.model_config.resolved.path,
                self.policy,
                self.cache,
            )
        return self._processor

    def process(
        self, prompt: Mapping[str, Any], cache_salt: str | None = None
    ) -> tuple[str, list[int], list[MultiModalFeatureSpec]]:
        if self.arch is None:
            raise ValueError(
                f"multi_modal_data: {self.model_config.arch.architecture} is a text-only model"
            )
        mm_data = prompt["multi_modal_data"]
        if not isinstance(mm_data, Mapping):
            raise ValueError("multi_modal_data must be a dict like {'image': [images]}")
        text = prompt.get("prompt")
        if not isinstance(text, str) or not text:
            raise ValueError("a prompt with multi_modal_data needs its text as 'prompt'")
        # An audio item is itself a (samples, sampling_rate) tuple, as in vLLM.
        items = {k: [v] if k == "audio" and isinstance(v, tuple) else v for k, v in mm_data.items()}
        items = {k: v if isinstance(v, list | tuple) else [v] for k, v in items.items()}
        for modality, values in items.items():
            limit = self.mm_config.limit_mm_per_prompt.get(modality)
            if limit is not None and len(values) > limit:
                raise ValueError(
                    f"multi_modal_data['{modality}'] has {len(values)} items, more than "
                    f"limit_mm_per_prompt allows ({limit})"
                )
        kwargs = dict(self.mm_config.mm_processor_kwargs or {})
        request_kwargs = prompt.get("mm_processor_kwargs")
        if request_kwargs is not None:
            if not isinstance(request_kwargs, Mapping):
                raise ValueError("mm_processor_kwargs must be a dict")
            kwargs.update(request_kwargs)
        add_special = prompt.get("add_special_tokens", True)
        processed = self.processor.process(
            text, items, kwargs, add_special_tokens=add_special, cache_salt=cache_salt
        )
        if self.arch.bidirectional_items and self.max_num_batched_tokens is not None:
            for i, feature in enumerate(processed.features):
                if feature.mm_position.length > self.max_num_batched_tokens:
                    raise ValueError(
                        f"multi_modal_data['image'][{i}] takes {feature.mm_position.length} "
                        f"tokens, more than max_num_batched_tokens "
                        f"({self.max_num_batched_tokens}): the model computes an image in "
                        "one step"
                    )
        return text, processed.token_ids, processed.features

    def commit(self, features: list[MultiModalFeatureSpec]) -> list[MultiModalFeatureSpec]:
        """Called once the request passed every check, right before it is sent."""
        return self.cache.commit(features)
