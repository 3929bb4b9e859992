"""Image parts of chat messages: loaded in message order and replaced by bare image parts
for the chat template; malformed parts are ValueErrors naming the part."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from kvserve.config import MultiModalConfig
from kvserve.engine.chat_media import extract_chat_images, has_image_parts, media_policy

PIXELS = np.random.default_rng(1).integers(0, 256, (8, 10, 3), dtype=np.uint8)


def _url() -> str:
    buf = io.BytesIO()
    Image.fromarray(PIXELS).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_images_come_out_in_order_and_parts_become_markers() -> None:
    pil = Image.fromarray(PIXELS[::-1].copy())
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "text", "text": "first"},
            {"type": "image_url", "image_url": {"url": _url()}},
            {"type": "image_pil", "image_pil": pil},
        ]},
    ]  # fmt: skip
    assert has_image_parts(messages) and not has_image_parts(messages[:1])
    out, images = extract_chat_images(messages, media_policy(MultiModalConfig()))
    assert out[0] == messages[0]
    assert out[1]["content"] == [{"type": "text", "text": "first"}, {"type": "image"}, {"type": "image"}]  # fmt: skip
    np.testing.assert_array_equal(images[0], PIXELS)  # type: ignore[arg-type]
    assert images[1] is pil


def test_malformed_parts_name_themselves() -> None:
    policy = media_policy(MultiModalConfig())
    cases = [
        ({"type": "image_url", "image_url": {}}, r"messages\[0\].content\[0\].image_url needs"),
        ({"type": "image_pil"}, r"messages\[0\].content\[0\] has no 'image_pil' value"),
        ({"type": "image_url", "image_url": {"url": "data:x"}}, r"content\[0\].image_url: a data"),
    ]
    for part, message in cases:
        with pytest.raises(ValueError, match=message):
            extract_chat_images([{"role": "user", "content": [part]}], policy)
