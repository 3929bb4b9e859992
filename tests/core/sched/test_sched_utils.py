"""check_stop: the order of the stop conditions."""

from __future__ import annotations

from collections.abc import Callable

from kvserve.core.request import Request, RequestStatus
from kvserve.core.sched.utils import check_stop

MakeRequest = Callable[..., Request]
EOS = 2


def generate(request: Request, tokens: list[int], max_model_len: int = 100) -> list[bool]:
    stops = []
    for token in tokens:
        request.append_output_token_ids(token)
        stops.append(check_stop(request, max_model_len))
    return stops


def test_eos_stops(make_request: MakeRequest) -> None:
    request = make_request(4)
    assert generate(request, [5, EOS]) == [False, True]
    assert request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason is None


def test_ignore_eos_keeps_going(make_request: MakeRequest) -> None:
    request = make_request(4, ignore_eos=True, max_tokens=3)
    assert generate(request, [EOS, EOS, EOS]) == [False, False, True]
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_min_tokens_suppresses_eos_and_stop_tokens(make_request: MakeRequest) -> None:
    request = make_request(4, min_tokens=3, stop_token_ids=[9])
    assert generate(request, [EOS, 9, EOS]) == [False, False, True]
    assert request.status == RequestStatus.FINISHED_STOPPED


def test_stop_token_sets_stop_reason(make_request: MakeRequest) -> None:
    request = make_request(4, stop_token_ids=[9, 11])
    assert generate(request, [5, 11]) == [False, True]
    assert request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason == 11


def test_length_caps_win_over_eos(make_request: MakeRequest) -> None:
    request = make_request(4, max_tokens=2)
    assert generate(request, [5, EOS]) == [False, True]
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    capped = make_request(4, max_tokens=50, min_tokens=10)
    # max_model_len 7: the prompt (4) plus 3 outputs reach it, min_tokens or not.
    assert generate(capped, [5, 5, 5], max_model_len=7) == [False, False, True]
    assert capped.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_no_max_tokens_runs_to_max_model_len(make_request: MakeRequest) -> None:
    request = make_request(4, max_tokens=None)
    assert generate(request, [5] * 6, max_model_len=10) == [False] * 5 + [True]
