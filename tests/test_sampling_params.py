"""SamplingParams refuses what the sampler cannot run, with a ValueError naming the field.

NaN is the case range checks miss (every comparison with it is false): before this check a
NaN temperature drew token ids outside the vocabulary and killed the engine core.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvserve.engine.parallel_sampling import ParentRequest
from kvserve.sampling_params import SamplingParams

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("temperature", {"temperature": NAN}),
        ("temperature", {"temperature": INF}),
        ("temperature", {"temperature": "nan"}),
        ("top_p", {"top_p": NAN}),
        ("min_p", {"min_p": NAN}),
        ("presence_penalty", {"presence_penalty": -INF}),
        ("frequency_penalty", {"frequency_penalty": NAN}),
        ("repetition_penalty", {"repetition_penalty": INF}),
        ("logit_bias[7]", {"logit_bias": {7: NAN}}),
        ("top_k", {"top_k": 1.5}),
        ("n", {"n": True}),
        ("max_tokens", {"max_tokens": 2.0}),
        ("seed", {"seed": 2**64}),
    ],
)
def test_non_finite_or_mistyped_values_are_refused_by_name(
    field: str, kwargs: dict[str, Any]
) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value).startswith(field + " "), info.value


def test_the_seeds_of_parallel_samples_stay_64_bit() -> None:
    parent = ParentRequest("r", SamplingParams(n=3, seed=2**63 - 1))
    seeds = [parent.get_child_info(i)[1].seed for i in range(3)]
    assert seeds == [2**63 - 1, -(2**63), -(2**63) + 1]
