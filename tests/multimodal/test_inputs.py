"""PlaceholderRange and MultiModalFeatureSpec: validated ranges, embedding counts, chunk
overlap, and a msgpack round trip (they cross the front end / engine core socket)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from kvserve.multimodal import MultiModalFeatureSpec, PlaceholderRange
from kvserve.multimodal.inputs import TensorData


def test_placeholder_range() -> None:
    r = PlaceholderRange(offset=5, length=4, is_embed=(False, True, True, False))
    assert r.end == 9 and r.num_embeds == 2
    assert PlaceholderRange(offset=0, length=3).num_embeds == 3
    # A chunk [start, end) of the prompt touches the range or not.
    assert r.overlaps(0, 6) and r.overlaps(8, 20) and not r.overlaps(0, 5)
    assert not r.overlaps(9, 12)
    with pytest.raises(ValueError, match="length > 0"):
        PlaceholderRange(offset=0, length=0)
    with pytest.raises(ValueError, match="is_embed has 1 entries"):
        PlaceholderRange(offset=0, length=2, is_embed=(True,))


def test_feature_spec_round_trips_as_msgpack() -> None:
    pixels = np.arange(2 * 3 * 4 * 4, dtype=np.float32).reshape(2, 3, 4, 4)
    spec = MultiModalFeatureSpec(
        modality="image",
        identifier="ab" * 32,
        mm_position=PlaceholderRange(offset=3, length=2),
        data={"pixel_values": TensorData.from_array(pixels)},
    )
    wire = msgspec.msgpack.encode(spec)
    back = msgspec.msgpack.decode(wire, type=MultiModalFeatureSpec)
    assert back == spec and back.data is not None
    np.testing.assert_array_equal(back.data["pixel_values"].to_numpy(), pixels)
    assert spec.data_nbytes == pixels.nbytes
    # torch tensors go the same way (bytes, never pickle)
    t = TensorData.from_array(torch.from_numpy(pixels))
    assert t == spec.data["pixel_values"]
    with pytest.raises(ValueError, match="Python objects"):
        TensorData.from_array(np.array([object()]))
