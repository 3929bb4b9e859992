"""SigLIP vision tower and Gemma 3's multimodal projector against HF transformers on a tiny
random Gemma 3 multimodal model: the image features (soft tokens) of two images match
HF's ``get_image_features``; weights load by HF's names; bad inputs are clear errors."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration

from kvserve.model_executor.models.gemma3_mm_projector import Gemma3MultiModalProjector
from kvserve.model_executor.models.siglip import SiglipVisionArch, SiglipVisionModel


@pytest.fixture(scope="module")
def hf_model() -> Gemma3ForConditionalGeneration:
    torch.manual_seed(0)
    config = Gemma3Config(
        text_config={
            "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 24,
            "vocab_size": 300, "sliding_window": 16,
        },
        vision_config={
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "image_size": 28, "patch_size": 7,
        },
        mm_tokens_per_image=4,
    )  # fmt: skip
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # HF initialises the projector to zeros; make it do something
        for name, param in model.named_parameters():
            if "multi_modal_projector" in name:
                param.normal_(0, 0.5)
    return model


def _ours(
    hf: Gemma3ForConditionalGeneration,
) -> tuple[SiglipVisionModel, Gemma3MultiModalProjector]:
    config = hf.config
    vision = SiglipVisionModel(SiglipVisionArch.from_hf(config.vision_config.to_dict()))
    state = hf.state_dict()
    tower = {k.split("vision_tower.", 1)[1]: v for k, v in state.items() if "vision_tower." in k}
    vision.load_weights(tower.items())
    vc = config.vision_config
    projector = Gemma3MultiModalProjector(
        vc.hidden_size, config.text_config.hidden_size, vc.image_size // vc.patch_size,
        config.mm_tokens_per_image, vc.layer_norm_eps,
    )  # fmt: skip
    proj = {
        k.split("multi_modal_projector.", 1)[1]: v
        for k, v in state.items()
        if "multi_modal_projector." in k
    }
    projector.load_weights(proj.items())
    return vision, projector


def test_image_features_match_hf(hf_model: Gemma3ForConditionalGeneration) -> None:
    vision, projector = _ours(hf_model)
    pixel_values = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model.model.get_image_features(pixel_values).pooler_output
        patches = vision(pixel_values)
        ours = projector(patches)
    assert patches.shape == (2, 16, 32)
    assert ours.shape == expected.shape == (2, 4, 48)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    # Each image is encoded alone: a batch of two equals two batches of one.
    with torch.no_grad():
        alone = projector(vision(pixel_values[1:]))
    torch.testing.assert_close(alone[0], ours[1], rtol=1e-6, atol=1e-6)


def test_bad_inputs_are_clear_errors(hf_model: Gemma3ForConditionalGeneration) -> None:
    vision, _ = _ours(hf_model)
    with pytest.raises(ValueError, match=r"pixel_values must be \[images, 3, 28, 28\]"):
        vision(torch.zeros(1, 3, 32, 32))
    with pytest.raises(ValueError, match="unexpected vision tower weight"):
        vision.load_weights([("encoder.bogus", torch.zeros(1))])
    with pytest.raises(ValueError, match="lacks image_size"):
        SiglipVisionArch.from_hf({"hidden_size": 8})
    with pytest.raises(ValueError, match="must be a square"):
        Gemma3MultiModalProjector(8, 8, 4, 3, 1e-6)
