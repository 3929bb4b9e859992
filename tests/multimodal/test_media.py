"""Images from URLs under the media policy: data URLs decode; file:// reads only under the
allowed directory (symlinks and '..' resolved first); http(s) only when enabled; corrupt,
non-image and oversized data are ValueErrors naming the field; arrays and tensors become
the same canonical pixels as the PIL image they hold."""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from kvserve.multimodal.media import MediaPolicy, load_image_url, to_rgb_array


def _png(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


PIXELS = np.random.default_rng(0).integers(0, 256, (12, 20, 3), dtype=np.uint8)


def test_data_and_file_urls(tmp_path: Path) -> None:
    policy = MediaPolicy(allowed_local_media_path=str(tmp_path / "media"))
    np.testing.assert_array_equal(load_image_url("f", _data_url(_png(PIXELS)), policy), PIXELS)
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "a.png").write_bytes(_png(PIXELS))
    (tmp_path / "secret.png").write_bytes(_png(PIXELS))
    os.symlink(tmp_path / "secret.png", tmp_path / "media" / "link.png")
    got = load_image_url("f", f"file://{tmp_path}/media/a.png", policy)
    np.testing.assert_array_equal(got, PIXELS)
    for outside in ("secret.png", "media/../secret.png", "media/link.png"):
        with pytest.raises(ValueError, match="outside the allowed local media path"):
            load_image_url("f", f"file://{tmp_path}/{outside}", policy)
    with pytest.raises(ValueError, match="local file URLs are disabled"):
        load_image_url("f", f"file://{tmp_path}/media/a.png", MediaPolicy())


def test_bad_urls_and_images() -> None:
    policy = MediaPolicy(max_image_pixels=100)
    cases = [
        ("https://example.org/a.png", "remote image URLs are disabled"),
        ("ftp://example.org/a.png", "unsupported URL scheme 'ftp'"),
        ("data:image/png,notbase64", "must be 'data:image/...;base64"),
        ("data:image/png;base64,%%%", "base64 payload is invalid"),
        (_data_url(b"hello, not an image"), "not an image Pillow can read"),
        (_data_url(_png(PIXELS)[:60]), "corrupt or truncated"),
        (_data_url(_png(PIXELS)), r"field: the image has 20x12 = 240 pixels, more than"),
    ]
    for url, message in cases:
        with pytest.raises(ValueError, match=message):
            load_image_url("field", url, policy if "pixels" in message else MediaPolicy())


def test_arrays_and_tensors_become_the_same_pixels() -> None:
    policy = MediaPolicy()
    image = Image.fromarray(PIXELS)
    for item in (
        image,
        PIXELS,
        torch.from_numpy(PIXELS),
        torch.from_numpy(PIXELS).permute(2, 0, 1),
    ):
        np.testing.assert_array_equal(to_rgb_array("f", item, policy), PIXELS)
    np.testing.assert_array_equal(to_rgb_array("f", image.convert("RGBA"), policy), PIXELS)
    with pytest.raises(ValueError, match="must be uint8"):
        to_rgb_array("f", PIXELS.astype(np.float32), policy)
    with pytest.raises(ValueError, match=r"must be \[H, W, 3\]"):
        to_rgb_array("f", PIXELS[:, :, :2], policy)


def test_remote_urls_when_enabled() -> None:
    import http.server
    import threading

    body = _png(PIXELS)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            found = self.path == "/cat.png"
            self.send_response(200 if found else 404)
            self.end_headers()
            if found:
                self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        policy = MediaPolicy(allow_remote_media=True)
        np.testing.assert_array_equal(load_image_url("f", f"{base}/cat.png", policy), PIXELS)
        with pytest.raises(ValueError, match="f: cannot fetch"):
            load_image_url("f", f"{base}/missing.png", policy)
    finally:
        server.shutdown()
        server.server_close()
