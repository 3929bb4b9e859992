"""Pooling methods fold a prompt's chunks into the same vector as the whole prompt."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.model_executor.layers.pooler import Pooler
from kvserve.pooling_params import PoolerConfig, PoolingParams


@pytest.mark.parametrize(
    ("pooling_type", "expected"),
    [("LAST", lambda h: h[-1]), ("CLS", lambda h: h[0]), ("MEAN", lambda h: h.mean(0))],
)
def test_chunked_fold_equals_whole_prompt(pooling_type: str, expected: object) -> None:
    hidden = torch.randn(11, 8)
    pooler = Pooler(PoolerConfig(pooling_type=pooling_type, normalize=False))
    state = None
    for start, end in ((0, 4), (4, 5), (5, 11)):
        state = pooler.fold(state, hidden[start:end], start)
    assert state is not None
    vector = torch.tensor(pooler.finish(state, 11, None))
    torch.testing.assert_close(vector, expected(hidden), atol=1e-6, rtol=1e-6)  # type: ignore[operator]


def test_request_params_override_normalisation_and_truncate() -> None:
    hidden = torch.randn(3, 8)
    pooler = Pooler(PoolerConfig(pooling_type="LAST"))  # normalises by default
    state = pooler.fold(None, hidden, 0)
    normalized = torch.tensor(pooler.finish(state, 3, None))
    torch.testing.assert_close(normalized, F.normalize(hidden[-1], dim=-1))
    raw = torch.tensor(pooler.finish(state, 3, PoolingParams(normalize=False)))
    torch.testing.assert_close(raw, hidden[-1])
    short = torch.tensor(pooler.finish(state, 3, PoolingParams(dimensions=4)))
    torch.testing.assert_close(short, F.normalize(hidden[-1, :4], dim=-1))


def test_pooler_config_validates() -> None:
    with pytest.raises(ValueError, match="pooling_type"):
        PoolerConfig(pooling_type="MAX")
    assert PoolerConfig(pooling_type="mean").pooling_type == "MEAN"
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=0)
