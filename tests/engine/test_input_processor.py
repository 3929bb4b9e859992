from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerBase

from kvserve.config import ModelConfig, SchedulerConfig
from kvserve.engine.input_processor import InputProcessor, apply_chat_template
from kvserve.sampling_params import SamplingParams
from kvserve.transformers_utils import get_tokenizer

MAX_LEN = 64


@pytest.fixture(scope="module")
def model_config() -> ModelConfig:
    return ModelConfig(max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def tok(model_config: ModelConfig) -> PreTrainedTokenizerBase:
    return get_tokenizer(model_config.tokenizer_resolved)


@pytest.fixture(scope="module")
def proc(model_config: ModelConfig, tok: PreTrainedTokenizerBase) -> InputProcessor:
    return InputProcessor(model_config, tok)


def test_text_prompt_is_tokenized_and_max_tokens_filled(
    proc: InputProcessor, tok: PreTrainedTokenizerBase
) -> None:
    params = SamplingParams(max_tokens=None, temperature=0.0)
    request, text = proc.process_inputs("r1", "Hello, world!", params, arrival_time=5.0)
    ids = tok.encode("Hello, world!")
    assert text == "Hello, world!"
    assert request.prompt_token_ids == ids and ids[0] != tok.bos_token_id  # no BOS added
    assert request.request_id == "r1" and request.arrival_time == 5.0
    assert request.eos_token_id == 2
    assert request.sampling_params.max_tokens == MAX_LEN - len(ids)
    assert params.max_tokens is None  # the caller's params are not modified
    same, _ = proc.process_inputs("r2", {"prompt": "Hello, world!"}, SamplingParams())
    assert same.prompt_token_ids == ids and same.sampling_params.max_tokens == 16


def test_token_prompt_passes_ids_through(proc: InputProcessor) -> None:
    request, text = proc.process_inputs("r", {"prompt_token_ids": [5, 6, 7]}, SamplingParams())
    assert request.prompt_token_ids == [5, 6, 7] and text is None
    _, text = proc.process_inputs(
        "r", {"prompt_token_ids": [5, 6], "prompt": "ab"}, SamplingParams()
    )
    assert text == "ab"


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("", "prompt is empty"),
        ({"prompt_token_ids": []}, "prompt_token_ids is empty"),
        ({"prompt_token_ids": [1, 49152]}, r"outside the vocabulary \[0, 49152\): \[49152\]"),
        ({"prompt_token_ids": [-1]}, "outside the vocabulary"),
        ({"prompt_token_ids": ["a"]}, "prompt_token_ids must be a list of integers"),
        (
            {"prompt_token_ids": [3] * MAX_LEN},
            rf"prompt \({MAX_LEN} tokens\) is longer than .* {MAX_LEN}",
        ),
        ("word " * 100, "is longer than the maximum model length of 64"),
        ({"prompt": "x", "multi_modal_data": {"image": 1}}, "multi_modal_data"),
        ({"text": "x"}, "'prompt'"),
        (42, "prompt must be"),
    ],
)
def test_invalid_prompts_are_rejected(proc: InputProcessor, prompt: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        proc.process_inputs("r", prompt, SamplingParams())  # type: ignore[arg-type]


def test_longest_allowed_prompt_leaves_one_token(proc: InputProcessor) -> None:
    ids = [3] * (MAX_LEN - 1)
    request, _ = proc.process_inputs(
        "r", {"prompt_token_ids": ids}, SamplingParams(max_tokens=None)
    )
    assert request.sampling_params.max_tokens == 1


def test_sampling_params_checked_against_vocab(proc: InputProcessor) -> None:
    with pytest.raises(ValueError, match="stop_token_ids"):
        proc.process_inputs("r", "hi", SamplingParams(stop_token_ids=[10**6]))
    with pytest.raises(ValueError, match="logit_bias"):
        proc.process_inputs("r", "hi", SamplingParams(logit_bias={-3: 1.0}))


def test_priority_needs_priority_policy(model_config: ModelConfig, proc: InputProcessor) -> None:
    with pytest.raises(ValueError, match=r"priority=3 .* 'priority' scheduling policy"):
        proc.process_inputs("r", "hi", SamplingParams(), priority=3)
    prio = InputProcessor(model_config, proc.tokenizer, SchedulerConfig(policy="priority"))
    request, _ = prio.process_inputs("r", "hi", SamplingParams(), priority=3, cache_salt="s")
    assert request.priority == 3 and request.cache_salt == "s"


def test_bad_words_tokenized_with_and_without_space(
    proc: InputProcessor, tok: PreTrainedTokenizerBase
) -> None:
    request, _ = proc.process_inputs("r", "hi", SamplingParams(bad_words=["hello world"]))
    got = request.sampling_params.bad_words_token_ids
    assert got == [
        tok.encode("hello world", add_special_tokens=False),
        tok.encode(" hello world", add_special_tokens=False),
    ]
    assert got[0] != got[1]


def test_chat_template_renders_conversation(tok: PreTrainedTokenizerBase) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
        },
    ]
    text = apply_chat_template(tok, messages)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi\nthere<|im_end|>\n<|im_start|>assistant\n"
    )
    cont = apply_chat_template(
        tok,
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}],
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert cont.endswith("<|im_start|>assistant\nHel")


@pytest.mark.parametrize(
    ("messages", "kwargs", "message"),
    [
        ([{"content": "hi"}], {}, r"messages\[0\] is missing 'role'"),
        (
            [{"role": "user", "content": "a"}, {"role": "user"}],
            {},
            r"messages\[1\] is missing 'content'",
        ),
        ([], {}, "non-empty list"),
        (["hi"], {}, r"messages\[0\] must be a dict"),
        ([{"role": "user", "content": 3}], {}, "must be a string or a list of text parts"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], {}, "'image_url'"),
        ([{"role": "user", "content": "hi"}], {"continue_final_message": True}, "cannot both"),
        (
            [{"role": "user", "content": "hi"}],
            {"chat_template": "{{ raise_exception('no') }}"},
            "failed",
        ),
    ],
)
def test_malformed_chat_messages(
    tok: PreTrainedTokenizerBase, messages: object, kwargs: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        apply_chat_template(tok, messages, **kwargs)  # type: ignore[arg-type]
