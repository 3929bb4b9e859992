"""Reasoning parsers over real token streams: outputs tokenized by a real tokenizer (the
default model's, where <think> is several tokens, and one with <think>/</think> added as
special tokens), fed delta by delta as the server streams them."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kvserve.entrypoints.openai.reasoning_parsers import (
    ReasoningParser,
    ReasoningParserManager,
    auto_reasoning_parser,
    make_reasoning_parser,
)
from kvserve.transformers_utils.model_resolver import resolve_model
from kvserve.transformers_utils.tokenizer import get_tokenizer

OPENED = "<|im_start|>assistant\n<think>\n"  # the template opened the reasoning
CLOSED = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # enable_thinking=False
PLAIN = "<|im_start|>assistant\n"

# (parser, prompt, output, reasoning, content)
CASES = [
    ("deepseek_r1", OPENED, "Two plus two.\nIt is 4.</think>\n\nThe answer is 4.",
     "Two plus two.\nIt is 4.", "\n\nThe answer is 4."),
    ("deepseek_r1", PLAIN, "<think>Let me see.</think>Paris.", "Let me see.", "Paris."),
    ("deepseek_r1", PLAIN, "Still thinking <thin", "Still thinking <thin", None),  # cut short
    ("deepseek_r1", CLOSED, "Just the answer.", None, "Just the answer."),
    ("qwen3", PLAIN, "<think>\nHmm, 3 < 4 </thi...\n</think>\n\n3 is less.",
     "\nHmm, 3 < 4 </thi...\n", "\n\n3 is less."),
    ("qwen3", PLAIN, "No thinking here </think> at all.", None,
     "No thinking here </think> at all."),
    ("qwen3", CLOSED, "<think>is content now", None, "<think>is content now"),
    ("qwen3", OPENED, "reasoning</think>answer", "reasoning", "answer"),
]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Any]:
    plain = get_tokenizer(resolve_model(None))
    special = copy.deepcopy(plain)  # get_tokenizer's is shared: not to be changed
    special.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    return {"multi-token tags": plain, "special-token tags": special}


def token_deltas(tokenizer: Any, text: str) -> list[str]:
    """The text deltas a stream of ``text``'s tokens carries (as the incremental
    detokenizer cuts them, special tokens kept: the parser asks for that)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, before = [], ""
    for i in range(1, len(ids) + 1):
        now = tokenizer.decode(ids[:i], skip_special_tokens=False)
        if now.endswith("\ufffd"):
            continue  # an incomplete character waits for its next byte
        deltas.append(now[len(before) :])
        before = now
    assert before == text
    return deltas


def streamed(parser: ReasoningParser, prompt: str, deltas: list[str]) -> tuple[str, str]:
    streamer = parser.streamer(prompt)
    reasoning, content = "", ""
    for i, delta in enumerate(deltas):
        r, c = streamer.feed(delta, finished=i == len(deltas) - 1)
        reasoning += r
        content += c
    return reasoning, content


@pytest.mark.parametrize("kind", ["multi-token tags", "special-token tags"])
@pytest.mark.parametrize(("name", "prompt", "output", "reasoning", "content"), CASES)
def test_split_streamed_equals_whole(
    tokenizers: dict[str, Any],
    kind: str,
    name: str,
    prompt: str,
    output: str,
    reasoning: str | None,
    content: str | None,
) -> None:
    tokenizer = tokenizers[kind]
    parser = ReasoningParserManager.get_reasoning_parser(name)(tokenizer)
    assert parser.extract_reasoning_content(output, prompt) == (reasoning, content)
    by_token = streamed(parser, prompt, token_deltas(tokenizer, output))
    assert by_token == (reasoning or "", content or "")
    # Any cut of the text into two deltas, a tag's included, gives the same split.
    for cut in range(len(output) + 1):
        assert streamed(parser, prompt, [output[:cut], output[cut:]]) == by_token, cut


def test_think_tokens_of_a_special_token_tokenizer(tokenizers: dict[str, Any]) -> None:
    special = tokenizers["special-token tags"]
    parser = ReasoningParserManager.get_reasoning_parser("deepseek_r1")(special)
    start, end = special.convert_tokens_to_ids(["<think>", "</think>"])
    tokens = parser.reasoning_tokens()
    assert tokens is not None
    assert (tokens.start_token_ids, tokens.end_token_ids) == ([start], [end])
    text_ids = special.encode("so</think>yes", add_special_tokens=False)
    assert not parser.is_reasoning_end([start, *text_ids[:1]])
    assert parser.is_reasoning_end(text_ids)
    assert not parser.is_reasoning_end([*text_ids, start])
    assert special.decode(parser.extract_content_ids(text_ids)) == "yes"
    # Special tags would be dropped from the text: the parser keeps them in.
    assert parser.adjust_skip_special_tokens(True) is False
    # Multi-token tags: no single think-end token, a grammar constrains all the output.
    plain = ReasoningParserManager.get_reasoning_parser("qwen3")(tokenizers["multi-token tags"])
    assert plain.reasoning_tokens() is None
    assert plain.adjust_skip_special_tokens(True) is True


def test_auto_decides_from_the_template(tokenizers: dict[str, Any]) -> None:
    plain, special = tokenizers["multi-token tags"], tokenizers["special-token tags"]
    # The default model's template has no think tags: no parser, output all content.
    assert auto_reasoning_parser(plain, None) is None
    assert make_reasoning_parser("auto", special, None) is None
    r1 = "{{ messages[0]['content'] }}{% if add_generation_prompt %}<think>\n{% endif %}</think>"
    assert auto_reasoning_parser(special, r1) == "deepseek_r1"
    qwen = r1 + "{% if enable_thinking is false %}<think></think>{% endif %}"
    parser = make_reasoning_parser("auto", special, qwen)
    assert parser is not None and parser.name == "qwen3"
    # Tags the tokenizer splits into pieces are no model's think tokens.
    assert auto_reasoning_parser(plain, r1) is None
    with pytest.raises(ValueError, match="unknown"):
        make_reasoning_parser("nope", plain, None)
