"""The encoder runner's position maps: which row of an item's output each placeholder
position takes, and which positions form one bidirectional block (an image or a crop)."""

from __future__ import annotations

import numpy as np

from kvserve.protocol.mm_inputs import MultiModalFeatureSpec, PlaceholderRange
from kvserve.worker.encoder_runner_mixin import _block_ids, _embed_index


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
