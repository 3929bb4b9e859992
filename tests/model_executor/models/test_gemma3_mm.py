"""Gemma3ForConditionalGeneration's weights load from the checkpoint layouts transformers 5
and 4 write (and the ``model.``-prefixed one); its image embeddings equal HF's
get_image_features, the image and its Pan-and-Scan crops flattened in order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from kvserve.config import ModelConfig
from kvserve.model_executor.models.gemma3_mm import Gemma3ForConditionalGeneration
from tests.multimodal.gemma3_mm_model import build_gemma3_vlm


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ModelConfig, Path]:
    directory: Path = tmp_path_factory.mktemp("gemma3_vlm_weights")
    hf, _ = build_gemma3_vlm(directory)
    return hf, ModelConfig(model=str(directory)), directory


def test_layouts_load_and_images_embed_like_hf(built: tuple[Any, ModelConfig, Path]) -> None:
    hf, config, directory = built
    # On disk (transformers 5): language_model.model.*, language_model.lm_head, vision_tower.*
    on_disk = dict(load_file(directory / "model.safetensors"))
    v4 = {
        k.replace("vision_tower.", "vision_tower.vision_model.", 1): t for k, t in on_disk.items()
    }
    # In memory: model.language_model.*, model.vision_tower.*, lm_head.weight
    prefixed = dict(hf.state_dict())
    pixels = torch.randn(3, 3, 28, 28, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf.model.get_image_features(pixels).pooler_output.reshape(-1, 64)
    for layout in (on_disk, v4, prefixed):
        model = Gemma3ForConditionalGeneration(config.arch)
        loaded = model.load_weights(layout.items())
        assert loaded == {n for n, _ in model.named_parameters()}
        with torch.no_grad():
            torch.testing.assert_close(model.embed_multimodal(pixels), expected)
    with pytest.raises(ValueError, match=r"unexpected Gemma 3 VLM weight 'bogus\.weight'"):
        Gemma3ForConditionalGeneration(config.arch).load_weights([("bogus.weight", torch.zeros(1))])
