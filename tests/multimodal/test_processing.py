"""The Gemma 3 processor (transformers' Gemma3Processor from the model directory, run item
by item): token ids and pixel values equal HF's whole-prompt processing, with and without
Pan-and-Scan; placeholder ranges cover each image's soft tokens (crops included, the text
between them not embedded); a cached item is not processed again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvserve.multimodal.media import MediaPolicy
from kvserve.multimodal.processing import Gemma3MultiModalProcessor, create_processor
from kvserve.multimodal.processor_cache import ProcessorCache
from tests.multimodal.gemma3_mm_model import (
    IMAGE_ID,
    PAN_AND_SCAN,
    TOKENS_PER_IMAGE,
    build_gemma3_vlm,
    random_image,
)

TWO = "<bos>A <start_of_image> and B <start_of_image>, compare."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    directory = tmp_path_factory.mktemp("gemma3_vlm_proc")
    _, processor = build_gemma3_vlm(directory)
    return directory, processor


@pytest.mark.parametrize("kwargs", [{}, PAN_AND_SCAN], ids=["plain", "pan_and_scan"])
def test_matches_hf_processing(model_dir: tuple[Path, Any], kwargs: dict[str, Any]) -> None:
    directory, hf = model_dir
    proc = create_processor(
        "Gemma3ForConditionalGeneration", str(directory), MediaPolicy(), ProcessorCache(1 << 20)
    )
    images = [random_image(1, 64, 24), random_image(2)]
    ours = proc.process(TWO, {"image": images}, kwargs)
    expected = hf(text=TWO, images=images, return_tensors="np", **kwargs)
    assert ours.token_ids == expected["input_ids"][0].tolist()
    pixels = np.concatenate([f.data["pixel_values"].to_numpy() for f in ours.features])  # type: ignore[index]
    np.testing.assert_array_equal(pixels, expected["pixel_values"])
    ids = np.asarray(ours.token_ids)
    covered = np.zeros(len(ids), dtype=bool)
    for feature in ours.features:
        pos = feature.mm_position
        embed = np.ones(pos.length, bool) if pos.is_embed is None else np.asarray(pos.is_embed)
        assert (ids[pos.offset : pos.end][embed] == IMAGE_ID).all()
        assert not (ids[pos.offset : pos.end][~embed] == IMAGE_ID).any()
        covered[pos.offset : pos.end][embed] = True
    assert covered.sum() == (ids == IMAGE_ID).sum()
    num_crops = 0 if not kwargs else 3  # the 64x24 image is cut in three crops
    assert ours.features[0].mm_position.num_embeds == TOKENS_PER_IMAGE * (1 + num_crops)


def test_cached_items_are_not_processed_again(model_dir: tuple[Path, Any]) -> None:
    directory, _ = model_dir
    cache = ProcessorCache(1 << 20)
    proc = Gemma3MultiModalProcessor(str(directory), MediaPolicy(), cache)
    image = random_image(3)
    first = proc.process(TWO, {"image": [image, image]}, {})
    assert proc.num_processed == 2  # nothing cached yet (the front end commits at the send)
    cache.commit(first.features)
    again = proc.process(TWO, {"image": [np.asarray(image), image]}, {})
    assert proc.num_processed == 2 and again.token_ids == first.token_ids
    assert {f.identifier for f in again.features} == {first.features[0].identifier}
    with pytest.raises(ValueError, match="image soft tokens of its own"):
        proc.process("<bos><image_soft_token> <start_of_image>", {"image": [image]}, {})
    # Another salt (another tenant): its own identifiers, so no cached entry of the first
    # (processor, encoder or EC-connector cache) can serve it; its own salt again does.
    salted = proc.process(TWO, {"image": [image, image]}, {}, cache_salt="tenant:b")
    assert proc.num_processed == 4 and salted.token_ids == first.token_ids
    assert {f.identifier for f in salted.features}.isdisjoint(f.identifier for f in first.features)
    cache.commit(salted.features)
    proc.process(TWO, {"image": [image, image]}, {}, cache_salt="tenant:b")
    assert proc.num_processed == 4
