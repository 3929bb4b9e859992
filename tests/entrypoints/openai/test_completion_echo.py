"""`echo: true` with `max_tokens: 0` on /v1/completions: the prompt and its log-probs only,
the request lm-eval's loglikelihood sends."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.entrypoints.openai.utils import RemoteServer
from tests.forced_tokens import forced_xargs

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CONTEXT = "The capital of France is"
CONTINUATION = " Paris, and the capital of Italy is Rome."


def test_echo_with_max_tokens_0_scores_the_prompt_only(
    server: RemoteServer, tokenizer: Any
) -> None:
    client = server.client()
    prompt = CONTEXT + CONTINUATION
    ids = tokenizer(prompt).input_ids
    scored = client.completions.create(
        model=MODEL, prompt=prompt, echo=True, max_tokens=0, logprobs=1, temperature=0
    )
    [choice] = scored.choices
    assert choice.text == prompt and choice.finish_reason == "length"
    assert scored.usage is not None
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (len(ids), 0)
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert "".join(lp.tokens) == prompt and len(lp.tokens) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs is not None
    assert lp.top_logprobs[0] is None  # nothing predicts the first token
    rows = zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True)
    for token, logprob, top in rows:
        assert logprob is not None and logprob <= 0 and top is not None
        assert top[token] == logprob and 1 <= len(top) <= 2  # the prompt's token and the best

    # The reference, free of prompt log-probs: the model made to emit the prompt after its
    # first token; output log-probs are the model's own (raw), so they must agree.
    reference = client.completions.create(
        model=MODEL,
        prompt=ids[:1],
        max_tokens=len(ids) - 1,
        logprobs=0,
        temperature=0,
        extra_body={"vllm_xargs": forced_xargs(ids[1:])},
    )
    ref = reference.choices[0].logprobs
    assert ref is not None and ref.token_logprobs is not None
    assert lp.token_logprobs[1:] == pytest.approx(ref.token_logprobs, abs=1e-3)

    # logprobs 0 (the other form lm-eval sends), a batch of prompts, and text without logprobs.
    batch = client.completions.create(
        model=MODEL, prompt=[CONTEXT, prompt], echo=True, max_tokens=0, logprobs=0
    )
    assert [c.text for c in batch.choices] == [CONTEXT, prompt]
    batch_lp = batch.choices[1].logprobs
    assert batch_lp is not None and batch_lp.token_logprobs is not None
    assert batch_lp.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-3)
    assert batch.usage is not None and batch.usage.completion_tokens == 0
    plain = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=0)
    assert plain.choices[0].text == prompt and plain.choices[0].logprobs is None
    stream = client.completions.create(
        model=MODEL, prompt=prompt, echo=True, max_tokens=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == prompt


def test_max_tokens_0_without_echo_is_a_400(server: RemoteServer) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        server.client().completions.create(model=MODEL, prompt=CONTEXT, max_tokens=0)
    assert exc.value.body is not None
    assert exc.value.body["param"] == "max_tokens"  # type: ignore[index]
