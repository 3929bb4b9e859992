"""Images in: from PIL images, numpy arrays, tensors and URLs to one RGB pixel array each,
with every failure a ValueError that names the offending field.

URLs (OpenAI's ``image_url`` parts): ``data:`` URLs always; ``file://`` paths only under
the directory the server allows (``--allowed-local-media-path``); ``http(s)`` only when
remote media are enabled (the server never fetches on a client's behalf otherwise).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import sys
import urllib.parse
import urllib.request
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

# Decompression bombs: Pillow warns above its own limit; ours is the configured one.
Image.MAX_IMAGE_PIXELS = None


@dataclass(frozen=True)
class MediaPolicy:
    """What the engine accepts: the largest image (pixels) and where URLs may point."""

    max_image_pixels: int = 16_000_000
    allowed_local_media_path: str | None = None
    allow_remote_media: bool = False
    remote_timeout_s: float = 10.0


def _check_size(field: str, width: int, height: int, policy: MediaPolicy) -> None:
    if width <= 0 or height <= 0:
        raise ValueError(f"{field}: the image is empty ({width}x{height})")
    if width * height > policy.max_image_pixels:
        raise ValueError(
            f"{field}: the image has {width}x{height} = {width * height} pixels, more than "
            f"the limit of {policy.max_image_pixels}"
        )


def _decode(field: str, data: bytes, policy: MediaPolicy) -> np.ndarray:
    try:
        image = Image.open(io.BytesIO(data))
        # The header alone gives the size: refuse a huge image before decoding it.
        _check_size(field, image.width, image.height, policy)
        image.load()
    except ValueError:
        raise
    except UnidentifiedImageError:
        raise ValueError(f"{field}: the data is not an image Pillow can read") from None
    except (OSError, SyntaxError, Image.DecompressionBombError) as e:
        raise ValueError(f"{field}: the image is corrupt or truncated ({e})") from None
    return to_rgb_array(field, image, policy)


def to_rgb_array(field: str, item: object, policy: MediaPolicy) -> np.ndarray:
    """``item`` (PIL image, ``[H, W, 3]`` / ``[3, H, W]`` uint8 array or tensor) as a
    C-contiguous ``[H, W, 3]`` uint8 array: the canonical pixels that are hashed."""
    if isinstance(item, Image.Image):
        _check_size(field, item.width, item.height, policy)
        if item.mode != "RGB":
            item = item.convert("RGB")
        return np.ascontiguousarray(np.asarray(item))
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(item, torch.Tensor):
        item = item.detach().cpu().numpy()
    if not isinstance(item, np.ndarray):
        raise ValueError(
            f"{field} must be a PIL image, a numpy array or a tensor, got {type(item).__name__}"
        )
    if item.dtype != np.uint8:
        raise ValueError(f"{field}: an image array must be uint8 pixels, got {item.dtype}")
    if item.ndim == 3 and item.shape[0] == 3 and item.shape[-1] != 3:
        item = item.transpose(1, 2, 0)  # [3, H, W] -> [H, W, 3]
    if item.ndim != 3 or item.shape[-1] != 3:
        raise ValueError(
            f"{field}: an image array must be [H, W, 3] or [3, H, W], got {item.shape}"
        )
    _check_size(field, item.shape[1], item.shape[0], policy)
    return np.ascontiguousarray(item)


def load_image_url(field: str, url: str, policy: MediaPolicy) -> np.ndarray:
    """The pixels behind an ``image_url``, under ``policy``'s rules."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"{field} must be a non-empty URL string")
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "data":
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ValueError(f"{field}: a data URL must be 'data:image/...;base64,<data>'")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{field}: the data URL's base64 payload is invalid") from None
        return _decode(field, data, policy)
    if scheme == "file":
        return _decode(field, _read_local(field, url, policy), policy)
    if scheme in ("http", "https"):
        if not policy.allow_remote_media:
            raise ValueError(
                f"{field}: remote image URLs are disabled on this server (start it with "
                "--allow-remote-media to fetch http(s) images)"
            )
        try:
            with urllib.request.urlopen(url, timeout=policy.remote_timeout_s) as response:
                data = response.read(policy.max_image_pixels * 4 + 1)
        except OSError as e:
            raise ValueError(f"{field}: cannot fetch {url}: {e}") from None
        return _decode(field, data, policy)
    raise ValueError(f"{field}: unsupported URL scheme {scheme!r} (data:, file:// or http(s)://)")


def _read_local(field: str, url: str, policy: MediaPolicy) -> bytes:
    root = policy.allowed_local_media_path
    if not root:
        raise ValueError(
            f"{field}: local file URLs are disabled (start the server with "
            "--allowed-local-media-path DIR)"
        )
    path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlsplit(url).path))
    root = os.path.realpath(root)
    # realpath resolves symlinks and "..": the file itself must lie under the root.
    if os.path.commonpath([path, root]) != root:
        raise ValueError(f"{field}: {path} is outside the allowed local media path {root}")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{field}: cannot read {path}: {e.strerror}") from None
