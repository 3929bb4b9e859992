"""A tiny random Gemma 3 VLM built with transformers (real Gemma3Processor config, 28-pixel
images): greedy tokens equal HF's with one image, two images, Pan-and-Scan on and off,
batched with text-only requests and with chunked prefill reaching into an image; LLM.chat
with image parts; a repeated image is processed once, encoded once and hits the prefix
cache (metrics); two different images behind identical text never share a KV block; bad
inputs are ValueErrors that name the field and leave the engine serving."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvserve import LLM, SamplingParams
from kvserve.metrics.reader import Counter, Gauge
from tests.multimodal.gemma3_mm_model import (
    IMAGE_ID,
    PAN_AND_SCAN,
    build_gemma3_vlm,
    hf_greedy,
    random_image,
)

MAX_TOKENS = 10
ONE = "<bos>Look: <start_of_image> what?"
TWO = "<bos>A <start_of_image> and B <start_of_image>, compare."
TEXT = "<bos>Just some text here"
# 20 text tokens first: block 0 (16 tokens) is text only, the image falls in block 1.
REMOTE = "https://example.org/cat.png"
LONG = "<bos>A long preamble, then <start_of_image> describe."


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    directory = tmp_path_factory.mktemp("gemma3_vlm")
    model, processor = build_gemma3_vlm(directory)
    return directory, model, processor


@pytest.fixture(scope="module")
def llm(vlm: tuple[Path, Any, Any]) -> Iterator[LLM]:
    engine = LLM(
        model=str(vlm[0]),
        kv_cache_memory=32 << 20,
        max_num_batched_tokens=96,
        block_size=16,
        disable_log_stats=False,
    )
    yield engine
    engine.llm_engine.shutdown()


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _mm_prompt(text: str, images: list[Any], **kwargs: Any) -> dict[str, Any]:
    return {"prompt": text, "multi_modal_data": {"image": images}, "mm_processor_kwargs": kwargs}


def _counters(llm: LLM) -> dict[str, int]:
    return {m.name: m.value for m in llm.get_metrics() if isinstance(m, Counter)}


@pytest.mark.parametrize("pan_and_scan", [False, True], ids=["plain", "pan_and_scan"])
def test_one_and_two_images_match_hf(
    llm: LLM, vlm: tuple[Path, Any, Any], pan_and_scan: bool
) -> None:
    _, model, processor = vlm
    kwargs = PAN_AND_SCAN if pan_and_scan else {}
    wide, square = random_image(1, 64, 24), random_image(2)
    for text, images in [(ONE, [wide]), (TWO, [wide, square])]:
        ids, expected = hf_greedy(model, processor, text, images, MAX_TOKENS, **kwargs)
        out = llm.generate(_mm_prompt(text, images, **kwargs), _params(), use_tqdm=False)[0]
        assert out.prompt_token_ids == ids
        assert list(out.outputs[0].token_ids) == expected, (text, pan_and_scan)
    if pan_and_scan:  # the wide image really was cut into crops (more soft tokens)
        assert len(ids) > len(processor(text=TWO, images=[wide, square])["input_ids"][0])


def test_batched_with_text_only_requests(llm: LLM, vlm: tuple[Path, Any, Any]) -> None:
    _, model, processor = vlm
    a, b = random_image(3), random_image(4, 30, 50)
    cases = [(TWO, [a, b]), (TEXT, []), (ONE, [b]), (LONG, [a])]
    expected = [hf_greedy(model, processor, t, imgs, MAX_TOKENS)[1] for t, imgs in cases]
    prompts: list[Any] = [_mm_prompt(t, imgs) if imgs else t for t, imgs in cases]
    outs = llm.generate(prompts, _params(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


def test_chunked_prefill_reaching_into_an_image(vlm: tuple[Path, Any, Any]) -> None:
    """A 12-token budget: the first chunk of ONE would end inside its image (positions
    10-13); the image's tokens attend to each other both ways, so the chunk stops before
    it and the image runs whole in the next one. TWO has two images across chunks."""
    directory, model, processor = vlm
    engine = LLM(model=str(directory), kv_cache_memory=16 << 20, max_num_batched_tokens=12)
    try:
        a, b = random_image(5), random_image(6, 64, 24)
        for text, images in [(ONE, [a]), (TWO, [a, b]), (LONG, [b])]:
            expected = hf_greedy(model, processor, text, images, MAX_TOKENS)[1]
            out = engine.generate(_mm_prompt(text, images), _params(), use_tqdm=False)[0]
            assert list(out.outputs[0].token_ids) == expected, text
        # An image longer than the step budget can never run: a clear error up front.
        with pytest.raises(ValueError, match=r"multi_modal_data\['image'\]\[0\] takes 84"):
            engine.generate(_mm_prompt(ONE, [b], **PAN_AND_SCAN), _params(), use_tqdm=False)
    finally:
        engine.llm_engine.shutdown()


def test_preemption_with_images(vlm: tuple[Path, Any, Any]) -> None:
    """A pool of 12 blocks for five two-image requests: requests are preempted and
    recomputed (their images' encoder outputs released and asked for again), and every
    one still gives HF's tokens."""
    directory, model, processor = vlm
    engine = LLM(
        model=str(directory),
        num_blocks_override=12,
        max_num_batched_tokens=96,
        block_size=16,
        disable_log_stats=False,
    )
    try:
        images = [random_image(40 + i) for i in range(5)]
        cases = [[images[i], images[(i + 1) % 5]] for i in range(5)]
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        outs = engine.generate([_mm_prompt(TWO, c) for c in cases], params, use_tqdm=False)
        for out, case in zip(outs, cases, strict=True):
            assert list(out.outputs[0].token_ids) == hf_greedy(model, processor, TWO, case, 40)[1]
        counters = _counters(engine)
        assert counters["kvserve:num_preemptions"] > 0
        assert counters["kvserve:mm_vision_tower_runs"] == 5  # one per distinct image
    finally:
        engine.llm_engine.shutdown()


def test_chat_with_image_parts(llm: LLM, vlm: tuple[Path, Any, Any]) -> None:
    _, model, processor = vlm
    image = random_image(7)
    png = io.BytesIO()
    image.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    for part in ({"type": "image_pil", "image_pil": image}, {"type": "image_url", "image_url": {"url": url}}):  # fmt: skip
        messages = [{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}]
        template_messages = [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}],
            }
        ]
        text = processor.apply_chat_template(template_messages, add_generation_prompt=True)
        expected = hf_greedy(model, processor, text, [image], MAX_TOKENS)[1]
        out = llm.chat(messages, _params(), use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == expected


def test_repeated_image_processed_once_encoded_once_and_prefix_cached(llm: LLM) -> None:
    image = random_image(8)
    # The same pixels as a numpy array: same hash, so the same cache entries.
    same_pixels = np.asarray(image)
    other_text = "<bos>Another question entirely: <start_of_image> and?"
    mm_inputs = llm.llm_engine.input_processor.mm_inputs
    assert mm_inputs is not None
    before = _counters(llm)
    first = llm.generate(_mm_prompt(LONG, [image]), _params(), use_tqdm=False)[0]
    processed = mm_inputs.processor.num_processed
    after_first = _counters(llm)
    # Other text before the same image: no prefix hit, so the encoder output is needed.
    llm.generate(_mm_prompt(other_text, [same_pixels]), _params(), use_tqdm=False)
    after_second = _counters(llm)
    # The first prompt again: its blocks, image included, come from the prefix cache.
    third = llm.generate(_mm_prompt(LONG, [same_pixels]), _params(), use_tqdm=False)[0]
    after = _counters(llm)

    def delta(name: str, start: dict[str, int], end: dict[str, int]) -> int:
        return end.get(f"kvserve:{name}", 0) - start.get(f"kvserve:{name}", 0)

    assert mm_inputs.processor.num_processed == processed  # not processed again
    assert delta("mm_processor_cache_hits", before, after_first) == 0
    assert delta("mm_processor_cache_hits", after_first, after) == 2  # sent as hash twice
    assert delta("mm_vision_tower_runs", before, after_first) == 1
    assert delta("mm_vision_tower_runs", after_first, after) == 0  # never encoded again
    assert delta("mm_encoder_cache_hits", after_first, after_second) == 1
    assert first.outputs[0].token_ids == third.outputs[0].token_ids
    full_blocks = (len(third.prompt_token_ids) - 1) // 16 * 16
    assert third.prompt_token_ids.index(IMAGE_ID) + 4 <= full_blocks  # image in the hit
    assert third.num_cached_tokens == full_blocks
    assert delta("prefix_cache_hits", after_second, after) == full_blocks


def test_different_images_never_share_a_kv_block(llm: LLM) -> None:
    a, b = random_image(9), random_image(10)
    first = llm.generate(_mm_prompt(LONG, [a]), _params(), use_tqdm=False)[0]
    out = llm.generate(_mm_prompt(LONG, [b]), _params(), use_tqdm=False)[0]
    assert out.prompt_token_ids == first.prompt_token_ids  # identical tokens
    # Block 0 is text only (shared); block 1 holds the image: not shared with a's.
    assert 16 <= out.prompt_token_ids.index(IMAGE_ID) < 32
    assert out.num_cached_tokens == 16
    two = llm.generate(_mm_prompt(TWO, [a, b]), _params(), use_tqdm=False)[0]
    swapped = llm.generate(_mm_prompt(TWO, [b, a]), _params(), use_tqdm=False)[0]
    assert two.prompt_token_ids == swapped.prompt_token_ids
    assert swapped.num_cached_tokens == 0  # the first image is in block 0: nothing shared


def test_bad_inputs_are_value_errors_and_the_engine_keeps_serving(
    llm: LLM, vlm: tuple[Path, Any, Any]
) -> None:
    image = random_image(11)
    bad: list[tuple[Any, str]] = [
        (_mm_prompt(ONE, [image] * 5), r"multi_modal_data\['image'\] has 5 items, more than"),
        (_mm_prompt(ONE, ["not an image"]), r"multi_modal_data\['image'\]\[0\] must be a PIL"),
        (_mm_prompt(ONE, [np.zeros((4, 4), np.float32)]), r"\[0\]: an image array must be uint8"),
        (_mm_prompt(TWO, [image]), "2 <start_of_image> placeholder"),
        (_mm_prompt(ONE, [image], bogus=1), "mm_processor_kwargs: unknown key 'bogus'"),
        ({"prompt": ONE, "multi_modal_data": {"audio": [b"x"]}}, "unsupported modality 'audio'"),
        (_mm_prompt(ONE, [random_image(0, 5000, 4000)]), r"\[0\]: the image has 5000x4000"),
    ]
    for prompt, message in bad:
        with pytest.raises(ValueError, match=message):
            llm.generate(prompt, _params(), use_tqdm=False)
    with pytest.raises(ValueError, match="remote image URLs are disabled"):
        llm.chat(
            [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": REMOTE}}],
                }
            ],
            _params(),
            use_tqdm=False,
        )
    # A request refused after processing (a duplicate id) never moved the processor
    # cache: its image, sent later, still travels with its pixels.
    engine = llm.llm_engine
    engine.add_request("dup", _mm_prompt(ONE, [image]), _params())
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("dup", _mm_prompt(ONE, [random_image(12)]), _params())
    while engine.has_unfinished_requests():
        engine.step()
    outs = llm.generate(
        [_mm_prompt(ONE, [random_image(12)]), _mm_prompt(ONE, [image])], _params(), use_tqdm=False
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [MAX_TOKENS] * 2
    assert not any(o.outputs[0].finish_reason == "error" for o in outs)
    gauges = {m.name: m.value for m in llm.get_metrics() if isinstance(m, Gauge)}
    assert gauges["kvserve:kv_cache_blocks_in_use"] == 0  # no block leaked


def test_a_backend_without_the_image_mask_is_refused(
    vlm: tuple[Path, Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 3's image tokens see their whole image; TRITON's kernel has no such mask yet, so
    it is refused at start-up rather than giving other tokens than HF's."""
    pytest.importorskip("triton")
    monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", "TRITON")
    with pytest.raises(ValueError, match=r"attend bidirectionally.*CPU_ATTN"):
        LLM(model=str(vlm[0]), kv_cache_memory=16 << 20)
