"""Images in chat messages (OpenAI's content parts): ``{"type": "image_url", "image_url":
{"url": ...}}`` and, offline, ``{"type": "image_pil", "image_pil": <PIL image>}`` or
``{"type": "image", "image": <PIL image | array | tensor>}``.

Each image part is loaded (URLs under the media policy) and replaced by a bare
``{"type": "image"}`` part, which the model's chat template renders as its image marker
(Gemma 3: ``<start_of_image>``); the images come back in message order for
``multi_modal_data``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvserve.config import MultiModalConfig
from kvserve.multimodal.media import MediaPolicy, load_image_url

_IMAGE_TYPES = ("image_url", "image_pil", "image")


def media_policy(config: MultiModalConfig) -> MediaPolicy:
    return MediaPolicy(
        max_image_pixels=config.max_image_pixels,
        allowed_local_media_path=config.allowed_local_media_path,
        allow_remote_media=config.allow_remote_media,
    )


def has_image_parts(messages: Any) -> bool:
    if not isinstance(messages, list | tuple):
        return False
    return any(
        isinstance(m, Mapping)
        and isinstance(m.get("content"), list)
        and any(isinstance(p, Mapping) and p.get("type") in _IMAGE_TYPES for p in m["content"])
        for m in messages
    )


def extract_chat_images(
    messages: list[Any], policy: MediaPolicy
) -> tuple[list[dict[str, Any]], list[object]]:
    """(messages with image parts as {"type": "image"}, the images in order)."""
    images: list[object] = []
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts: list[Any] = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            field = f"messages[{i}].content[{j}]"
            if kind == "image_url":
                spec = part.get("image_url")
                url = spec.get("url") if isinstance(spec, Mapping) else spec
                if not isinstance(url, str):
                    raise ValueError(f"{field}.image_url needs a 'url' string")
                images.append(load_image_url(f"{field}.image_url", url, policy))
            elif kind in ("image_pil", "image"):
                if part.get(kind) is None:
                    raise ValueError(f"{field} has no {kind!r} value")
                images.append(part[kind])
            else:
                parts.append(part)
                continue
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, images
