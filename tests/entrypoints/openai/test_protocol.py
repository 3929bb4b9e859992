"""Request bodies -> SamplingParams, and the error body shape (no server needed)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from kvserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIServingError,
)
from kvserve.sampling_params import RequestOutputKind

HI = [{"role": "user", "content": "hi"}]


def test_completion_request_maps_openai_and_vllm_fields() -> None:
    req = CompletionRequest.model_validate(
        {
            "prompt": "hi",
            "max_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "n": 2,
            "seed": 3,
            "stop": "\n",
            "presence_penalty": 0.1,
            "frequency_penalty": 0.2,
            "logit_bias": {"42": 1.5},
            "logprobs": 2,
            "top_k": 5,
            "min_p": 0.05,
            "repetition_penalty": 1.2,
            "min_tokens": 2,
            "ignore_eos": True,
            "stop_token_ids": [7],
            "store": False,  # fields we do not use are accepted
        }
    )
    sp = req.to_sampling_params(max_tokens=7)
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.n, sp.seed) == (7, 0.5, 0.9, 2, 3)
    assert sp.stop == ["\n"] and sp.stop_token_ids == [7] and sp.logit_bias == {42: 1.5}
    assert (sp.top_k, sp.min_p, sp.repetition_penalty, sp.min_tokens) == (5, 0.05, 1.2, 2)
    assert sp.ignore_eos and sp.logprobs == 2
    assert sp.output_kind == RequestOutputKind.FINAL_ONLY
    streamed = CompletionRequest(prompt="hi", stream=True).to_sampling_params(max_tokens=1)
    assert streamed.output_kind == RequestOutputKind.DELTA
    assert streamed.temperature == 1.0  # OpenAI's default when not given


def test_chat_request_max_tokens_and_logprobs() -> None:
    req = ChatCompletionRequest(messages=HI, max_tokens=50, max_completion_tokens=9)
    assert req.requested_max_tokens() == 9  # the newer name wins
    assert ChatCompletionRequest(messages=HI).requested_max_tokens() is None
    sp = ChatCompletionRequest(messages=HI, logprobs=True, top_logprobs=3).to_sampling_params(4)
    assert sp.logprobs == 3
    assert ChatCompletionRequest(messages=HI).to_sampling_params(4).logprobs is None
    with pytest.raises(ValueError, match="top_logprobs needs logprobs"):
        ChatCompletionRequest(messages=HI, top_logprobs=2).to_sampling_params(4)
    with pytest.raises(
        ValueError, match="top_logprobs\n  Input should be less than or equal to 20"
    ):
        ChatCompletionRequest(messages=HI, logprobs=True, top_logprobs=21).to_sampling_params(4)
    with pytest.raises(ValueError, match="logit_bias keys"):
        ChatCompletionRequest(messages=HI, logit_bias={"x": 1.0}).to_sampling_params(4)


def test_bad_bodies_fail_validation() -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": "hi"})
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"max_tokens": 3})


def test_error_body_has_openai_shape() -> None:
    body = OpenAIServingError("no such model", status=404, param="model").to_response()
    assert body.model_dump() == {
        "error": {
            "message": "no such model",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


def test_an_sse_event_stays_one_line_for_splitlines_readers() -> None:
    # Generated text may hold U+2028, U+2029 or U+0085: raw in JSON, but line breaks to
    # str.splitlines(), which httpx's aiter_lines uses (a soak client saw half an event).
    from kvserve.entrypoints.openai.protocol import ErrorInfo, sse_data

    text = "a\u2028b\x85c\u2029d\n"
    event = sse_data(ErrorInfo(message=text, type="t", code=400))
    lines = event.splitlines()
    assert lines[1:] == [""] and lines[0].startswith("data: ")
    assert json.loads(lines[0].removeprefix("data: "))["message"] == text
