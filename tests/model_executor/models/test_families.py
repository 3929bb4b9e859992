"""Every model family through ``LLM`` against HF transformers on the same tiny random
checkpoint: greedy tokens identical through batching, chunked prefill (16-token budget),
prefix caching and preemption (a pool too small for the batch), logprobs within 1e-3.
The checkpoints carry no tokenizer: ``skip_tokenizer_init`` runs them on token ids."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvserve.entrypoints.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.family_models import FAMILIES, build_family_model, hf_greedy, hf_log_softmax
from tests.reference import assert_no_leak

MAX_TOKENS = 10
BLOCK_SIZE = 4


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    kind = request.param
    path = tmp_path_factory.mktemp(kind)
    reference = build_family_model(kind, path)
    # 20 usable blocks of 4 tokens: the batch below needs ~40, so requests get preempted.
    llm = LLM(
        str(path), skip_tokenizer_init=True, block_size=BLOCK_SIZE,
        max_num_batched_tokens=16, num_blocks_override=21,
    )  # fmt: skip
    yield kind, path, reference, llm
    llm.llm_engine.shutdown()


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (9, 23, 14, 30)]
    return [*prompts, prompts[0] + prompts[2]]  # shares its first blocks with prompt 0


def test_greedy_matches_hf_through_batching_chunking_and_preemption(family: Any) -> None:
    kind, _, reference, llm = family
    prompts = _prompts(reference.config.vocab_size)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    before = scheduler.num_preemptions
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == hf_greedy(reference, prompt, MAX_TOKENS), kind
        assert output.outputs[0].text == ""  # no tokenizer, no text
    assert scheduler.num_preemptions > before, "the small pool should have preempted"
    assert_no_leak(llm)


def test_prefix_hit_gives_identical_tokens(family: Any) -> None:
    kind, _, reference, llm = family
    prompt = _prompts(reference.config.vocab_size)[3]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.reset_prefix_cache()
    first = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    again = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert list(again.outputs[0].token_ids) == hf_greedy(reference, prompt, MAX_TOKENS), kind
    assert_no_leak(llm)


def test_logprobs_within_tolerance(family: Any) -> None:
    kind, _, reference, llm = family
    prompt = _prompts(reference.config.vocab_size)[1]
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3, prompt_logprobs=1
    )
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    tokens = list(out.outputs[0].token_ids)
    expected = hf_log_softmax(reference, prompt + tokens)
    assert out.outputs[0].logprobs is not None
    for step, (token, top) in enumerate(zip(tokens, out.outputs[0].logprobs, strict=True)):
        row = expected[len(prompt) - 1 + step]
        for token_id, logprob in top.items():
            assert abs(logprob.logprob - float(row[token_id])) < 1e-3, (kind, step, token_id)
        assert token in top
    assert out.prompt_logprobs is not None
    for pos in range(1, len(prompt)):
        got = out.prompt_logprobs[pos][prompt[pos]].logprob
        assert abs(got - float(expected[pos - 1][prompt[pos]])) < 1e-3, (kind, pos)


def test_text_prompt_without_tokenizer_is_a_clear_error(family: Any) -> None:
    _, _, _, llm = family
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    assert_no_leak(llm)
