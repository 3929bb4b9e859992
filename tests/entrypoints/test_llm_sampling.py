"""Every sampling parameter has a visible effect end to end; seeded sampling reproduces."""

from __future__ import annotations

from typing import Any

import pytest

from kvserve.sampling_params import SamplingParams
from tests.prompts import CHAT_PROMPTS, chat_to_ids
from tests.reference import assert_no_leak

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prompt(llm: Any) -> dict[str, list[int]]:
    return {"prompt_token_ids": chat_to_ids(llm.get_tokenizer(), CHAT_PROMPTS[1])}


def tokens(llm: Any, prompt: Any, **params: Any) -> list[int]:
    params.setdefault("max_tokens", 24)
    out = llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]
    return list(out.outputs[0].token_ids)


def text(llm: Any, prompt: Any, **params: Any) -> str:
    params.setdefault("max_tokens", 24)
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs[0].text


def test_seeded_sampling_reproduces_across_runs_and_batches(llm: Any, prompt: Any) -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=24)
    alone = llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == again
    # Same request in a bigger batch, at another position, next to unseeded requests.
    others = [{"prompt_token_ids": [1, 2, 3, 4, 5, 6]}, {"prompt_token_ids": [7] * 40}]
    mixed = llm.generate(
        [others[0], prompt, others[1]],
        [
            SamplingParams(temperature=1.0, max_tokens=30),
            seeded,
            SamplingParams(temperature=0.7, max_tokens=5),
        ],
        use_tqdm=False,
    )
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = tokens(llm, prompt, temperature=1.0, seed=99)
    assert other_seed != list(alone)
    assert_no_leak(llm)


def test_temperature_and_filters(llm: Any, prompt: Any) -> None:
    greedy = tokens(llm, prompt, temperature=0.0)
    # Filters that keep only the top token are greedy whatever the temperature.
    assert tokens(llm, prompt, temperature=1.5, top_k=1, seed=3) == greedy
    assert tokens(llm, prompt, temperature=1.5, top_p=1e-6, seed=3) == greedy
    assert tokens(llm, prompt, temperature=1.5, min_p=1.0, seed=3) == greedy
    # A high temperature without filters wanders off the greedy path.
    samples = {tuple(tokens(llm, prompt, temperature=2.0, seed=s)) for s in range(3)}
    assert tuple(greedy) not in samples and len(samples) == 3
    assert_no_leak(llm)


def test_max_and_min_tokens(llm: Any, prompt: Any) -> None:
    assert len(tokens(llm, prompt, temperature=0.0, max_tokens=5)) == 5
    natural = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=200), use_tqdm=False)[
        0
    ].outputs[0]
    assert natural.finish_reason == "stop" and len(natural.token_ids) < 200
    longer = tokens(
        llm, prompt, temperature=0.0, max_tokens=200, min_tokens=len(natural.token_ids) + 10
    )
    assert len(longer) >= len(natural.token_ids) + 10
    ignore = llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(ignore.token_ids) == 60 and ignore.finish_reason == "length"
    assert_no_leak(llm)


def test_stop_strings_and_stop_token_ids(llm: Any, prompt: Any) -> None:
    full = text(llm, prompt, temperature=0.0, max_tokens=40)
    word = full.split()[2]
    out = llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=40, stop=[word]), use_tqdm=False
    )[0].outputs[0]
    assert out.text == full[: full.index(word)]
    assert out.finish_reason == "stop" and out.stop_reason == word
    kept = text(
        llm, prompt, temperature=0.0, max_tokens=40, stop=[word], include_stop_str_in_output=True
    )
    assert kept == full[: full.index(word) + len(word)]

    greedy = tokens(llm, prompt, temperature=0.0)
    stop_id = greedy[3]
    out = llm.generate(
        prompt,
        SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0]
    completion = out.outputs[0]
    assert list(completion.token_ids) == greedy[: greedy.index(stop_id) + 1]
    assert completion.stop_reason == stop_id
    assert_no_leak(llm)


def test_logit_bias_allowed_tokens_and_bad_words(llm: Any, prompt: Any) -> None:
    tokenizer = llm.get_tokenizer()
    forced = tokenizer.encode(" banana", add_special_tokens=False)[0]
    assert set(tokens(llm, prompt, temperature=0.0, logit_bias={forced: 100.0})) == {forced}

    allowed = tokenizer.encode(" yes no maybe", add_special_tokens=False)
    assert set(tokens(llm, prompt, temperature=0.8, seed=5, allowed_token_ids=allowed)) <= set(
        allowed
    )

    full = text(llm, prompt, temperature=0.0, max_tokens=40)
    banned = full.split()[1].strip(".,")
    filtered = text(llm, prompt, temperature=0.0, max_tokens=40, bad_words=[banned])
    assert banned not in filtered.split() and filtered != full
    assert_no_leak(llm)


def test_penalties_change_and_reduce_repetition(llm: Any) -> None:
    looping = {"prompt_token_ids": llm.get_tokenizer().encode("one two one two one two one")}
    base = tokens(llm, looping, temperature=0.0, max_tokens=30, ignore_eos=True)

    def repeats(ids: list[int]) -> int:
        return len(ids) - len(set(ids))

    for penalty in (
        {"repetition_penalty": 1.8},
        {"presence_penalty": 2.0},
        {"frequency_penalty": 2.0},
    ):
        penalised = tokens(llm, looping, temperature=0.0, max_tokens=30, ignore_eos=True, **penalty)
        assert penalised != base, penalty
        assert repeats(penalised) < repeats(base), penalty
    assert_no_leak(llm)


def test_special_tokens_and_n(llm: Any, prompt: Any) -> None:
    # Past EOS (ignore_eos) the model writes its turn markers, special tokens both.
    shown = text(
        llm, prompt, temperature=0.0, max_tokens=40, ignore_eos=True, skip_special_tokens=False
    )
    hidden = text(llm, prompt, temperature=0.0, max_tokens=40, ignore_eos=True)
    assert "<|im_end|>" in shown and "<|im_end|>" not in hidden
    # A request that stops at EOS never shows the EOS token, as in vLLM.
    assert "<|im_end|>" not in text(
        llm, prompt, temperature=0.0, max_tokens=200, skip_special_tokens=False
    )

    out = llm.generate(
        prompt, SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=16), use_tqdm=False
    )[0]
    assert len(out.outputs) == 2
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    assert_no_leak(llm)
