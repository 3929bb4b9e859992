"""The encoder runner's position maps: which row of an item's output each placeholder
position takes, and which positions form one bidirectional block (an image or a crop);
the component itself on a fake vision model, and its no-op form for text models."""

from __future__ import annotations

import numpy as np
import torch

from kvserve.protocol.mm_inputs import MultiModalFeatureSpec, PlaceholderRange, TensorData
from kvserve.protocol.runner_output import EncoderRunStats
from kvserve.protocol.scheduler_output import NewRequestData, SchedulerOutput
from kvserve.sample.sampling_batch import SamplingBatch
from kvserve.sampling_params import SamplingParams
from kvserve.worker.encoder_runner import (
    EncoderRunner,
    MultiModalEncoderRunner,
    _block_ids,
    _embed_index,
)
from kvserve.worker.input_batch import InputBatch
from kvserve.worker.input_preparation import InputPreparer
from kvserve.worker.request_states import RequestStates


def test_position_maps_of_an_image_with_crops() -> None:
    # Two runs of 2 embeddings with 3 text tokens between (an image and one crop).
    is_embed = (True, True, False, False, False, True, True)
    feature = MultiModalFeatureSpec("image", "h", PlaceholderRange(10, 7, is_embed))
    index = _embed_index(feature)
    assert index is not None
    np.testing.assert_array_equal(index, [0, 1, -1, -1, -1, 2, 3])
    np.testing.assert_array_equal(_block_ids(feature), [0, 0, -1, -1, -1, 1, 1])
    plain = MultiModalFeatureSpec("image", "h", PlaceholderRange(0, 4))
    assert _embed_index(plain) is None
    np.testing.assert_array_equal(_block_ids(plain), [0, 0, 0, 0])


class FakeVisionModel:
    """Embeds token t as [t, t]; an image's pixels [n, 2] are its n embeddings."""

    def __init__(self) -> None:
        self.encoded = 0

    def embed_input_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids.to(torch.float32)[:, None].repeat(1, 2)

    def embed_multimodal(self, pixels: torch.Tensor) -> torch.Tensor:
        self.encoded += 1
        return pixels


def _image_request() -> tuple[RequestStates, InputBatch, MultiModalFeatureSpec]:
    cpu = torch.device("cpu")
    batch = InputBatch(2, 16, 16, cpu, [4], SamplingBatch(2, 64, cpu))
    states = RequestStates(cpu, None)
    states.bind_batch(batch)
    pixels = np.full((3, 2), -1.0, dtype=np.float32)
    feature = MultiModalFeatureSpec(
        "image", "img", PlaceholderRange(2, 3), {"pixel_values": TensorData.from_array(pixels)}
    )
    new = NewRequestData("r", [5, 6, 9, 9, 9, 7], SamplingParams(), ([1, 2],), 0)
    new.mm_features = [feature]
    batch.add_request(states.add(new))
    return states, batch, feature


def test_multimodal_runner_caches_encodes_merges_and_frees() -> None:
    model = FakeVisionModel()
    runner = MultiModalEncoderRunner(torch.device("cpu"), False, None)
    runner.set_model(model)
    states, batch, feature = _image_request()
    step = SchedulerOutput.empty()
    step.scheduled_encoder_inputs = {"r": [0]}
    runner.execute_mm_encoder(step, states)
    assert set(runner.encoder_cache) == {"img"} and model.encoded == 1
    # A chunk over positions 0..3 takes the first two image embeddings at 2 and 3.
    inputs = InputPreparer(2, 16, torch.device("cpu"), False).prepare(batch, {"r": 4}, 4)
    kwargs = runner.model_kwargs(batch, inputs, None)
    assert kwargs["inputs_embeds"][:, 0].tolist() == [5.0, 6.0, -1.0, -1.0]
    assert model.encoded == 1  # served from the cache
    stats = runner.take_encoder_stats()
    assert stats is not None and stats.vision_tower_runs == 1
    assert runner.take_encoder_stats() == EncoderRunStats()  # counters restart
    free = SchedulerOutput.empty()
    free.free_encoder_mm_hashes = [feature.identifier]
    runner.execute_mm_encoder(free, states)
    assert runner.encoder_cache == {}


def test_text_model_encoder_runner_is_a_no_op() -> None:
    runner = EncoderRunner()
    runner.set_model(object())
    step = SchedulerOutput.empty()
    runner.execute_mm_encoder(step, RequestStates(torch.device("cpu"), None))
    assert runner.model_kwargs(None, None, None) == {}  # type: ignore[arg-type]
    assert runner.take_encoder_stats() is None
    runner.shutdown()
