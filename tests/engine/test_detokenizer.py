from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerBase

from kvserve.engine.detokenizer import (
    BaseIncrementalDetokenizer,
    FastIncrementalDetokenizer,
    IncrementalDetokenizer,
    SlowIncrementalDetokenizer,
)
from kvserve.protocol.engine_core import EngineCoreRequest
from kvserve.sampling_params import SamplingParams
from kvserve.transformers_utils import get_tokenizer, resolve_model

EOS = 2  # <|im_end|>
UNICODE_TEXT = (
    "Hi there . it's ok , ok?<|im_end|> café naïve Ünïcödé 😀😀 🇫🇷 日本語のテキスト "
    "∑ 𝔘 Ελληνικά\n\n  two spaces\tand a tab. <|im_start|>user\nDone!"
)


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    return get_tokenizer(resolve_model(None))


def make_request(
    tok: PreTrainedTokenizerBase, prompt: str = "Write something:", **params: object
) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id="r",
        prompt_token_ids=tok.encode(prompt),
        sampling_params=SamplingParams(**params),  # type: ignore[arg-type]
        eos_token_id=EOS,
        arrival_time=0.0,
    )


def feed(detok: IncrementalDetokenizer, ids: list[int], chunk: int) -> str | None:
    for i in range(0, len(ids), chunk):
        stop = detok.update(ids[i : i + chunk], False)
        if stop is not None:
            return stop
    return None


@pytest.mark.parametrize("cls", [FastIncrementalDetokenizer, SlowIncrementalDetokenizer])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_incremental_text_equals_full_decode(
    tok: PreTrainedTokenizerBase,
    cls: type[BaseIncrementalDetokenizer],
    skip_special_tokens: bool,
    chunk: int,
) -> None:
    ids = tok.encode(UNICODE_TEXT * 5)
    # A chat prompt that ends in special tokens and a newline primes the decoder.
    prompt = tok.apply_chat_template([{"role": "user", "content": "héllo"}], tokenize=False)
    request = make_request(tok, prompt, skip_special_tokens=skip_special_tokens)
    detok = cls(tok, request)
    assert feed(detok, ids, chunk) is None
    assert detok.get_next_output_text(finished=True, delta=False) == tok.decode(
        ids, skip_special_tokens=skip_special_tokens
    )
    assert detok.output_token_ids == ids


def test_factory_picks_fast_path_and_no_op_without_detokenize(
    tok: PreTrainedTokenizerBase,
) -> None:
    fast = IncrementalDetokenizer.from_new_request(tok, make_request(tok))
    assert isinstance(fast, FastIncrementalDetokenizer)
    plain = IncrementalDetokenizer.from_new_request(tok, make_request(tok, detokenize=False))
    assert type(plain) is IncrementalDetokenizer
    assert plain.update([5, 6], False) is None
    assert plain.output_token_ids == [5, 6]
    assert plain.get_next_output_text(True, False) == ""
    assert type(IncrementalDetokenizer.from_new_request(None, make_request(tok))) is (
        IncrementalDetokenizer
    )


def test_incomplete_utf8_at_the_end_matches_full_decode(tok: PreTrainedTokenizerBase) -> None:
    ids = tok.encode("ok 😀")
    cut = ids[:-1]  # the emoji's last byte token is missing
    detok = FastIncrementalDetokenizer(tok, make_request(tok))
    detok.update(cut, False)
    assert "\ufffd" not in detok.get_next_output_text(finished=False, delta=False)
    assert detok.get_next_output_text(finished=True, delta=False) == tok.decode(cut)


@pytest.mark.parametrize("include", [False, True])
def test_eos_token_text_only_with_include_stop_str(
    tok: PreTrainedTokenizerBase, include: bool
) -> None:
    ids = [*tok.encode("Bye now"), EOS]
    request = make_request(tok, skip_special_tokens=False, include_stop_str_in_output=include)
    detok = FastIncrementalDetokenizer(tok, request)
    detok.update(ids[:-1], False)
    assert detok.update(ids[-1:], stop_terminated=True) is None
    text = detok.get_next_output_text(finished=True, delta=False)
    assert text == ("Bye now<|im_end|>" if include else "Bye now")
    assert detok.output_token_ids == ids


@pytest.mark.parametrize(
    ("include", "expected"), [(False, "Hello world"), (True, "Hello world. Good")]
)
def test_stop_string_truncates_text(
    tok: PreTrainedTokenizerBase, include: bool, expected: str
) -> None:
    ids = tok.encode("Hello world. Goodbye and more text")
    request = make_request(tok, stop=[". Good", "more"], include_stop_str_in_output=include)
    detok = FastIncrementalDetokenizer(tok, request)
    assert feed(detok, ids, 1) == ". Good"
    assert detok.get_next_output_text(finished=True, delta=False) == expected


def test_earliest_stop_string_wins_within_one_update(tok: PreTrainedTokenizerBase) -> None:
    ids = tok.encode("alpha beta gamma delta")
    detok = FastIncrementalDetokenizer(tok, make_request(tok, stop=["delta", "beta"]))
    assert detok.update(ids, False) == "beta"
    assert detok.get_next_output_text(finished=True, delta=False) == "alpha "


def test_stop_string_split_across_tokens(tok: PreTrainedTokenizerBase) -> None:
    ids = tok.encode("The quick brown fox jumps")
    stop = "ck bro"  # spans the tokens " quick" and " brown"
    pieces = [tok.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces)
    detok = FastIncrementalDetokenizer(tok, make_request(tok, stop=[stop]))
    assert feed(detok, ids, 1) == stop
    assert detok.get_next_output_text(finished=True, delta=False) == "The qui"


def test_min_tokens_ignores_early_stop_strings(tok: PreTrainedTokenizerBase) -> None:
    ids = tok.encode("stop here, and stop there")
    first_stop_tokens = len(tok.encode("stop"))
    request = make_request(tok, stop=["stop"], min_tokens=first_stop_tokens + 1)
    detok = FastIncrementalDetokenizer(tok, request)
    assert feed(detok, ids, 1) == "stop"
    assert detok.get_next_output_text(finished=True, delta=False) == "stop here, and "


@pytest.mark.parametrize("delta", [True, False])
def test_streamed_text_never_shows_a_partial_stop_string(
    tok: PreTrainedTokenizerBase, delta: bool
) -> None:
    ids = tok.encode("Say STO then STOP! and more")
    detok = FastIncrementalDetokenizer(tok, make_request(tok, stop=["STOP!"]))
    final = "Say STO then "
    streamed = ""
    for token_id in ids:
        stop = detok.update([token_id], False)
        piece = detok.get_next_output_text(finished=stop is not None, delta=delta)
        streamed = streamed + piece if delta else piece
        # Whatever was shown is text the final output keeps.
        assert final.startswith(streamed), streamed
        if stop is not None:
            break
    assert stop == "STOP!"
    assert streamed == final


def test_unfinished_delta_holds_back_stop_length_minus_one(
    tok: PreTrainedTokenizerBase,
) -> None:
    detok = FastIncrementalDetokenizer(tok, make_request(tok, stop=["xyz!"]))
    detok.update(tok.encode("abcdefgh"), False)
    assert detok.get_next_output_text(finished=False, delta=True) == "abcde"
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    assert detok.get_next_output_text(finished=True, delta=True) == "fgh"
