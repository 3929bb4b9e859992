"""Whisper through LLM.generate on a tiny random checkpoint: greedy tokens equal HF's for
the same log-mel features (audio at the model's rate, resampled audio, vLLM's explicit
encoder/decoder prompt), the same audio in two requests runs the encoder once, and bad
audio is a ValueError naming the field while the engine keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvserve import LLM, SamplingParams
from kvserve.metrics.reader import Counter, Gauge
from kvserve.multimodal.audio import resample
from kvserve.utils.census import leftovers
from tests.multimodal.whisper_model import (
    DECODER_START,
    EOT_ID,
    SAMPLING_RATE,
    build_whisper,
    hf_greedy,
    random_audio,
)

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def whisper(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any, list[int]]:
    directory = tmp_path_factory.mktemp("whisper")
    model, extractor = build_whisper(directory)
    from transformers import AutoTokenizer

    prefix = AutoTokenizer.from_pretrained(directory).encode(
        DECODER_START, add_special_tokens=False
    )
    return directory, model, extractor, prefix


@pytest.fixture(scope="module")
def llm(whisper: tuple[Path, Any, Any, list[int]]) -> Iterator[LLM]:
    engine = LLM(
        model=str(whisper[0]), kv_cache_memory=8 << 20, block_size=16, disable_log_stats=False
    )
    yield engine
    engine.llm_engine.shutdown()


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def _prompt(audio: Any) -> dict[str, Any]:
    return {"prompt": DECODER_START, "multi_modal_data": {"audio": audio}}


def _encoder_runs(llm: LLM) -> int:
    counters = {m.name: m.value for m in llm.get_metrics() if isinstance(m, Counter)}
    return int(counters["kvserve:mm_vision_tower_runs"])


def test_generate_matches_hf(llm: LLM, whisper: tuple[Path, Any, Any, list[int]]) -> None:
    _, model, extractor, prefix = whisper
    clips = [random_audio(1), random_audio(2, seconds=0.3), random_audio(3, seconds=1.0)]
    at_8k = random_audio(4)[::2].copy()
    prompts: list[Any] = [_prompt((clip, SAMPLING_RATE)) for clip in clips]
    prompts.append(_prompt((at_8k, 8000)))  # resampled to 16 kHz first
    # vLLM's explicit form, and a bare waveform (at the model's rate).
    prompts.append(
        {
            "encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": clips[0]}},
            "decoder_prompt": DECODER_START,
        }
    )
    expected_audio = [*clips, resample(at_8k, 8000, SAMPLING_RATE), clips[0]]
    outs = llm.generate(prompts, _params(), use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    want = [hf_greedy(model, extractor, a, prefix, MAX_TOKENS) for a in expected_audio]
    assert got == want
    assert len({tuple(t) for t in want}) >= 3  # the audio matters to the tokens


def test_same_audio_runs_the_encoder_once(
    llm: LLM, whisper: tuple[Path, Any, Any, list[int]]
) -> None:
    _, model, extractor, prefix = whisper
    clip = random_audio(7)
    before = _encoder_runs(llm)
    outs = llm.generate([_prompt((clip, SAMPLING_RATE))] * 2, _params(), use_tqdm=False)
    assert _encoder_runs(llm) - before == 1
    want = hf_greedy(model, extractor, clip, prefix, MAX_TOKENS)
    assert [list(o.outputs[0].token_ids) for o in outs] == [want, want]
    # Later, while the encoder output is still cached: no run at all.
    llm.generate([_prompt((clip.copy(), SAMPLING_RATE))], _params(), use_tqdm=False)
    assert _encoder_runs(llm) - before == 1


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        (DECODER_START, r"needs its encoder input"),
        (_prompt((random_audio(1, seconds=1.5), SAMPLING_RATE)), r"audio'\]\[0\].*window of 1 s"),
        (_prompt((np.full(100, np.nan, np.float32), SAMPLING_RATE)), r"NaN"),
        (_prompt((np.zeros(0, np.float32), SAMPLING_RATE)), r"audio'\]\[0\]: the audio is empty"),
        (_prompt((np.zeros((2, 100), np.float32), SAMPLING_RATE)), r"one channel"),
        (_prompt([random_audio(1), random_audio(2)]), r"exactly one clip"),
        (_prompt((random_audio(1), "16k")), r"sampling_rate: int"),
        ({"encoder_prompt": {"prompt": "x"}, "decoder_prompt": "a"}, r"encoder_prompt"),
    ],
    ids=["no_audio", "too_long", "nan", "empty", "stereo_shape", "two_clips", "bad_rate", "enc"],
)
def test_bad_audio_is_a_value_error(
    llm: LLM, whisper: tuple[Path, Any, Any, list[int]], prompt: Any, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], _params(), use_tqdm=False)
    _, model, extractor, prefix = whisper
    clip = random_audio(11)
    out = llm.generate([_prompt(clip)], _params(), use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(model, extractor, clip, prefix, MAX_TOKENS)


def test_preemption_and_shared_encoder_blocks(whisper: tuple[Path, Any, Any, list[int]]) -> None:
    """A pool of 12 blocks (a request holds 4 encoder blocks and up to 3 decoder blocks)
    for five requests over three clips: requests are preempted and recomputed (their
    encoder K/V written again from the encoder cache), requests with the same clip take
    shared encoder blocks (tests/core/test_cross_attention_manager.py counts them), and
    every one still gives HF's tokens; no block is left held."""
    directory, model, extractor, prefix = whisper
    engine = LLM(
        model=str(directory),
        num_blocks_override=12,
        block_size=16,
        max_num_batched_tokens=64,
        disable_log_stats=False,
    )
    try:
        clips = [random_audio(20 + i) for i in range(3)]
        cases = [clips[0], clips[1], clips[0], clips[2], clips[1]]
        params = SamplingParams(max_tokens=40, temperature=0.0)
        outs = engine.generate([_prompt(c) for c in cases], params, use_tqdm=False)
        want = {i: hf_greedy(model, extractor, c, prefix, 40) for i, c in enumerate(clips)}
        for out, case in zip(outs, cases, strict=True):
            index = next(i for i, c in enumerate(clips) if c is case)
            assert list(out.outputs[0].token_ids) == want[index]
        counters = {m.name: m.value for m in engine.get_metrics() if isinstance(m, Counter)}
        assert counters["kvserve:num_preemptions"] > 0
        gauges = {m.name: m.value for m in engine.get_metrics() if isinstance(m, Gauge)}
        assert gauges["kvserve:kv_cache_usage_perc"] == 0.0
        # The scheduler's KV cache and encoder state (the workers learn of the last
        # finished requests in the next step, which an idle LLM does not take).
        census = engine.llm_engine.request_census()["engine_core"]
        assert any("req_to_encoder_key" in key for key in census)
        held = {
            k: n
            for k, n in census.items()
            if k.startswith(("scheduler.kv_cache", "scheduler.encoder"))
        }
        assert held and leftovers({"core": held}) == {}
    finally:
        engine.llm_engine.shutdown()


def test_the_models_suppressed_tokens_apply_as_in_hfs_generate(
    whisper: tuple[Path, Any, Any, list[int]], tmp_path: Path
) -> None:
    """Real checkpoints carry suppress_tokens (never emitted) and begin_suppress_tokens
    (never emitted first) in their generation config; HF's generate applies both. Here
    the same weights suppress the token the plain model emits most, and begin-suppress
    each clip's plain first token and EOT; a request that starts while another is mid-way
    through its output has its own first step."""
    _, model, extractor, prefix = whisper
    clips = [random_audio(1), random_audio(2, seconds=0.3), random_audio(3, seconds=1.0)]
    plain = [hf_greedy(model, extractor, clip, prefix, MAX_TOKENS) for clip in clips]
    tokens = [t for toks in plain for t in toks]
    suppress = [max(set(tokens), key=tokens.count)]
    begin = sorted({toks[0] for toks in plain} | {EOT_ID})
    directory = tmp_path / "whisper-suppressing"
    model, extractor = build_whisper(directory, suppress, begin)
    want = [hf_greedy(model, extractor, clip, prefix, MAX_TOKENS) for clip in clips]
    assert want != plain
    assert all(toks[0] not in begin and suppress[0] not in toks for toks in want)

    llm = LLM(model=str(directory), kv_cache_memory=8 << 20, block_size=16)
    engine = llm.llm_engine
    try:
        got: dict[str, list[int]] = {}
        engine.add_request("0", _prompt((clips[0], SAMPLING_RATE)), _params())
        for step in range(40):
            if step == 3:  # "0" is generating; "1" and "2" start now
                for i in (1, 2):
                    engine.add_request(str(i), _prompt((clips[i], SAMPLING_RATE)), _params())
            for out in engine.step():
                if out.finished:
                    got[out.request_id] = list(out.outputs[0].token_ids)
            if len(got) == len(clips):
                break
        assert [got[str(i)] for i in range(len(clips))] == want
    finally:
        engine.shutdown()
