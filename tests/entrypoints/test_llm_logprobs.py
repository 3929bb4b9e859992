"""Sample and prompt logprobs agree with HF's log-softmax on the same weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvserve.sampling_params import SamplingParams
from tests.prompts import all_prompt_ids
from tests.reference import assert_no_leak, hf_reference

pytestmark = pytest.mark.slow
TOL = 1e-3


@pytest.mark.parametrize("prompt_index", [3, 6])
def test_logprobs_and_prompt_logprobs_match_hf(llm: Any, prompt_index: int) -> None:
    prompt = all_prompt_ids(llm.get_tokenizer())[prompt_index]
    params = SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=5
    )
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    completion = out.outputs[0]
    tokens = list(completion.token_ids)
    ref = hf_reference().log_softmax(prompt + tokens)

    assert completion.logprobs is not None and len(completion.logprobs) == len(tokens)
    for step, (token, entry) in enumerate(zip(tokens, completion.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + step]
        top_values, top_ids = torch.topk(row, 5)
        assert token in entry and entry[token].rank == 1
        for rank, (token_id, value) in enumerate(
            zip(top_ids.tolist(), top_values.tolist(), strict=False), 1
        ):
            assert token_id in entry, f"step {step}: top-{rank} token {token_id} missing"
            assert abs(entry[token_id].logprob - value) < TOL
            assert entry[token_id].rank == rank
    cumulative = sum(completion.logprobs[i][t].logprob for i, t in enumerate(tokens))
    assert completion.cumulative_logprob == pytest.approx(cumulative, abs=1e-4)

    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        entry = out.prompt_logprobs[position]
        assert entry is not None
        token = prompt[position]
        want = ref[position - 1]
        assert abs(entry[token].logprob - float(want[token])) < TOL
        assert entry[token].rank == int((want > want[token]).sum()) + 1
        top_values, top_ids = torch.topk(want, 5)
        for token_id, value in zip(top_ids.tolist(), top_values.tolist(), strict=True):
            assert abs(entry[token_id].logprob - value) < TOL
    assert_no_leak(llm)


def test_prompt_logprobs_with_chunked_prefill(llm_factory: Any) -> None:
    engine = llm_factory(max_num_batched_tokens=64)
    prompt = max(all_prompt_ids(engine.get_tokenizer()), key=len)[:300]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = engine.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    ref = hf_reference().log_softmax(prompt)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    worst = max(
        abs(out.prompt_logprobs[i][prompt[i]].logprob - float(ref[i - 1, prompt[i]]))
        for i in range(1, len(prompt))
    )
    assert worst < TOL
    assert_no_leak(engine)
