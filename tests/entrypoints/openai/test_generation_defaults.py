"""The server's request defaults follow the model's generation config."""

from __future__ import annotations

from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

DEFAULTS = {"temperature": 0.3, "top_k": 5, "top_p": 0.8, "repetition_penalty": 1.2}


def test_defaults_fill_what_the_request_leaves_out() -> None:
    params = CompletionRequest(prompt="x").to_sampling_params(16, DEFAULTS)
    assert (params.temperature, params.top_k, params.top_p, params.repetition_penalty) == (
        0.3,
        5,
        0.8,
        1.2,
    )
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], temperature=0.9)
    params = chat.to_sampling_params(16, DEFAULTS)
    assert (params.temperature, params.top_k) == (0.9, 5)


def test_no_defaults_are_vllm_defaults() -> None:
    params = CompletionRequest(prompt="x").to_sampling_params(16)
    assert (params.temperature, params.top_k, params.top_p, params.repetition_penalty) == (
        1.0,
        0,
        1.0,
        1.0,
    )
