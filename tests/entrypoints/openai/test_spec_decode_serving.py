"""Speculative decoding behind the OpenAI server: streaming emits every token once and in
order when a step accepts several drafts, and the acceptance counters reach /metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.entrypoints.openai.utils import RemoteServer

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "red green blue yellow, red green blue yellow, red green blue yellow, red green"


@pytest.fixture(scope="module")
def spec_server() -> Iterator[RemoteServer]:
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    remote = RemoteServer("--speculative-config", json.dumps(config))
    yield remote
    remote.stop()


def test_streaming_emits_each_token_once_in_order(spec_server: RemoteServer) -> None:
    client = spec_server.client()
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0.0, logprobs=0)
    whole = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert whole.choices[0].logprobs is not None
    want_tokens = whole.choices[0].logprobs.tokens
    assert len(want_tokens) == 40

    before = spec_server.metrics()
    chunks = list(
        client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    after = spec_server.metrics()
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    tokens = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]
    assert text == whole.choices[0].text
    assert tokens == want_tokens
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 40
    # Steps did emit several tokens: fewer chunks with text than tokens.
    accepted = "kvserve:spec_decode_num_accepted_tokens_total"
    assert after[accepted] - before.get(accepted, 0.0) > 10
    assert len([c for c in chunks if c.choices and c.choices[0].text]) < 40


def test_acceptance_counters_reach_metrics(spec_server: RemoteServer) -> None:
    spec_server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.0
    )
    values = spec_server.metrics()
    drafts = values["kvserve:spec_decode_num_drafts_total"]
    drafted = values["kvserve:spec_decode_num_draft_tokens_total"]
    accepted = values["kvserve:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and 0 < accepted <= drafted <= 4 * drafts
    assert "kvserve:spec_decode_num_accepted_tokens_per_pos_total" in values
