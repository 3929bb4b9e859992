"""Gemma 3 vision-language model (``Gemma3ForConditionalGeneration``): SigLIP vision tower
+ multimodal projector + the Gemma 3 language model.

The model runner drives it in two parts, as vLLM's multimodal interface does:
``embed_multimodal`` turns one image's pixel values (the image and its Pan-and-Scan
crops) into its soft-token embeddings, which the runner caches by content hash;
``embed_input_ids`` gives the text embeddings (scaled by sqrt(hidden), as HF's scaled
embedding does), into which the runner writes the image embeddings at the placeholder
positions (unscaled, as HF's ``masked_scatter``); ``forward`` then runs the language model
on those embeddings. Image tokens attend to the tokens of their own image both ways,
which the runner expresses in the attention metadata (``PrefillChunk.extra_visible``).

Checkpoint names: transformers 5 (``language_model.model.*``, ``vision_tower.*``) and 4
(``language_model.model.*``, ``vision_tower.vision_model.*``), and the ``model.``-prefixed
layout (``model.language_model.*``, ``lm_head``) all load.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from kvserve.model_executor.models.gemma3 import Gemma3ForCausalLM
from kvserve.model_executor.models.gemma3_mm_projector import Gemma3MultiModalProjector
from kvserve.model_executor.models.siglip import SiglipVisionArch, SiglipVisionModel
from kvserve.transformers_utils.arch_config import ArchConfig


class Gemma3ForConditionalGeneration(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        if arch.multimodal is None:
            raise ValueError("Gemma3ForConditionalGeneration needs a vision config")
        mm = arch.multimodal
        self.arch = arch
        vision_arch = SiglipVisionArch.from_hf(mm.vision_config)
        self.vision_tower = SiglipVisionModel(vision_arch)
        self.multi_modal_projector = Gemma3MultiModalProjector(
            vision_arch.hidden_size,
            arch.hidden_size,
            vision_arch.image_size // vision_arch.patch_size,
            mm.mm_tokens_per_image,
            vision_arch.layer_norm_eps,
        )
        self.language_model = Gemma3ForCausalLM(arch)
        self.image_size = vision_arch.image_size

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[crops, 3, S, S]`` (one image with its crops) -> ``[crops * tokens, hidden]``."""
        pixel_values = pixel_values.to(self.vision_tower.post_layernorm.weight.dtype)
        features = self.multi_modal_projector.forward(self.vision_tower.forward(pixel_values))
        return features.reshape(-1, features.shape[-1])

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.language_model.model.forward(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)

    def greedy_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.language_model.greedy_tokens(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        text: list[tuple[str, torch.Tensor]] = []
        vision: list[tuple[str, torch.Tensor]] = []
        projector: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith("vision_tower."):
                vision.append((name.removeprefix("vision_tower."), tensor))
            elif name.startswith("multi_modal_projector."):
                projector.append((name.removeprefix("multi_modal_projector."), tensor))
            elif name.startswith("language_model.") or name == "lm_head.weight":
                text.append((_text_name(name), tensor))
            else:
                raise ValueError(f"unexpected Gemma 3 VLM weight {name!r}")
        loaded = {f"vision_tower.{n}" for n in self.vision_tower.load_weights(vision)}
        loaded |= {
            f"multi_modal_projector.{n}" for n in self.multi_modal_projector.load_weights(projector)
        }
        loaded |= {f"language_model.{n}" for n in self.language_model.load_weights(_iter(text))}
        return loaded


def _text_name(name: str) -> str:
    """A checkpoint's text weight name -> Gemma3ForCausalLM's (``model.*``, ``lm_head``)."""
    name = name.removeprefix("language_model.")
    if name.startswith(("model.", "lm_head.")):
        return name
    return f"model.{name}"  # the model.language_model.layers.* layout


def _iter(items: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    yield from items
