"""/v1/chat/completions with image_url parts through a real `kvserve serve` process serving a
tiny random Gemma 3 VLM, with the official openai client: a data URL and an allowed
file:// path give HF's tokens; a repeat is a processor cache hit and no new vision tower
run; a corrupt image, a non-image, an oversized image, too many images, a remote URL and
a path outside the allowed directory each get a 400 in OpenAI's error shape, and the
server keeps serving."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.entrypoints.openai.utils import RemoteServer
from tests.multimodal.gemma3_mm_model import build_gemma3_vlm, hf_greedy, random_image

pytestmark = pytest.mark.slow

MAX_TOKENS = 8


def _data_url(image: Any, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def _messages(*urls: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}]


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RemoteServer, Any]]:
    root = tmp_path_factory.mktemp("vlm_server")
    model, processor = build_gemma3_vlm(root / "model")
    (root / "media").mkdir()
    random_image(21).save(root / "media" / "cat.png")
    random_image(22).save(root / "secret.png")
    server = RemoteServer(
        str(root / "model"),
        "--max-num-batched-tokens", "96",
        "--allowed-local-media-path", str(root / "media"),
        "--limit-mm-per-prompt", json.dumps({"image": 2}),
        "--max-image-pixels", "10000",
    )  # fmt: skip
    server.root = root  # type: ignore[attr-defined]
    yield server, (model, processor)
    server.stop()


def _expected(reference: Any, images: list[Any]) -> tuple[str, int]:
    """HF's reply text and prompt length."""
    model, processor = reference
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": "What is it?"}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True
    )
    ids, tokens = hf_greedy(model, processor, text, images, MAX_TOKENS)
    return str(processor.tokenizer.decode(tokens)), len(ids)


def _chat(client: openai.OpenAI, messages: list[dict[str, Any]]) -> str:
    return _chat_usage(client, messages)[0]


def _chat_usage(client: openai.OpenAI, messages: list[dict[str, Any]]) -> tuple[str, int]:
    model = client.models.list().data[0].id
    response = client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True, "skip_special_tokens": False},
    )
    assert response.usage is not None
    return response.choices[0].message.content or "", response.usage.prompt_tokens


def test_image_urls_give_hf_tokens_and_repeats_hit_the_caches(
    vlm_server: tuple[RemoteServer, Any],
) -> None:
    server, reference = vlm_server
    client = server.client()
    image = random_image(20, 64, 24)
    # The reply and the prompt's length (image placeholders expanded) are HF's.
    assert _chat_usage(client, _messages(_data_url(image))) == _expected(reference, [image])
    before = server.metrics()
    assert _chat_usage(client, _messages(_data_url(image))) == _expected(reference, [image])
    after = server.metrics()
    hits = "kvserve:mm_processor_cache_hits_total"
    runs = "kvserve:mm_vision_tower_runs_total"
    assert after[hits] == before[hits] + 1
    assert after[runs] == before[runs]  # the prefix cache and encoder cache cover it
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=_messages(_data_url(image)),  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "skip_special_tokens": False},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage is not None and (text, usage.prompt_tokens) == _expected(reference, [image])
    root: Path = server.root  # type: ignore[attr-defined]
    from PIL import Image

    cat = Image.open(root / "media" / "cat.png").convert("RGB")
    url = f"file://{root}/media/cat.png"
    assert _chat_usage(client, _messages(url)) == _expected(reference, [cat])


def test_bad_images_get_400_and_the_server_keeps_serving(
    vlm_server: tuple[RemoteServer, Any],
) -> None:
    server, _ = vlm_server
    root: Path = server.root  # type: ignore[attr-defined]
    good = _data_url(random_image(23))
    png = base64.b64decode(good.split(",", 1)[1])
    corrupt = "data:image/png;base64," + base64.b64encode(png[: len(png) // 2]).decode()
    not_image = "data:image/png;base64," + base64.b64encode(b"plain text, no pixels").decode()
    cases = [
        (_messages(corrupt), "corrupt or truncated"),
        (_messages(not_image), "not an image"),
        (_messages(_data_url(random_image(24, 200, 100))), "more than the limit of 10000"),
        (_messages(good, good, good), "3 items, more than limit_mm_per_prompt allows"),
        (_messages("https://example.org/cat.png"), "remote image URLs are disabled"),
        (_messages(f"file://{root}/secret.png"), "outside the allowed local media path"),
        (_messages(f"file://{root}/media/../secret.png"), "outside the allowed local media"),
    ]
    client = server.client()
    for messages, message in cases:
        response = httpx.post(
            server.url("/v1/chat/completions"),
            json={"messages": messages, "max_tokens": 2},
            timeout=60,
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert message in error["message"] and error["code"] == 400
        with pytest.raises(openai.BadRequestError, match="400"):
            _chat(client, messages)
        assert len(_chat(client, _messages(good))) > 0  # still serving
    assert server.proc.poll() is None
    assert server.metrics()["kvserve:kv_cache_blocks_in_use"] == 0


def test_concurrent_requests_with_repeated_images(vlm_server: tuple[RemoteServer, Any]) -> None:
    """Many requests at once, images repeating: each is right (the processor cache and
    its mirror in the core stay in step however the requests interleave)."""
    import asyncio

    server, reference = vlm_server
    images = [random_image(30 + i, 30 + 7 * i, 28) for i in range(3)]
    expected = [_expected(reference, [image])[0] for image in images]
    order = [0, 1, 0, 2, 1, 0, 2, 2, 1, 0, 0, 1]
    client = server.async_client()

    async def ask(i: int) -> str:
        model = (await client.models.list()).data[0].id
        response = await client.chat.completions.create(
            model=model,
            messages=_messages(_data_url(images[i])),  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            extra_body={"ignore_eos": True, "skip_special_tokens": False},
        )
        return response.choices[0].message.content or ""

    async def run() -> list[str]:
        return await asyncio.gather(*(ask(i) for i in order))

    assert asyncio.run(run()) == [expected[i] for i in order]
