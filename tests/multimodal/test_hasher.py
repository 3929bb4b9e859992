"""MultiModalHasher: equal pixels hash alike whatever holds them (a PNG file, a decoded
JPEG's lossless copy, a numpy array, a tensor); one differing pixel, another modality or
another value type changes the hash; values it cannot serialise canonically are refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from kvserve.multimodal import MultiModalHasher


def _pixels(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (48, 64, 3), dtype=np.uint8)


def _hash(value: object) -> str:
    return MultiModalHasher.hash_kwargs(image=value)


def test_equal_pixels_hash_alike_across_formats_arrays_and_tensors(tmp_path: Path) -> None:
    pixels = _pixels()
    png = tmp_path / "a.png"
    Image.fromarray(pixels).save(png)
    # A JPEG decodes to other pixels than its source; its decoded pixels saved losslessly
    # (PNG, and a BMP elsewhere) are what must hash like the decoded JPEG itself.
    jpeg = tmp_path / "a.jpg"
    Image.fromarray(pixels).save(jpeg, quality=80)
    decoded = Image.open(jpeg)
    decoded.load()
    Image.fromarray(np.asarray(decoded)).save(tmp_path / "jpeg_copy.png")
    Image.fromarray(np.asarray(decoded)).save(tmp_path / "b.bmp")

    from_png = _hash(Image.open(png))
    assert from_png == _hash(pixels) == _hash(torch.from_numpy(pixels))
    assert from_png == _hash(Image.open(tmp_path / "a.png").copy())  # path plays no part
    from_jpeg = _hash(decoded)
    assert from_jpeg == _hash(Image.open(tmp_path / "jpeg_copy.png"))
    assert from_jpeg == _hash(Image.open(tmp_path / "b.bmp"))
    assert from_jpeg == _hash(np.array(decoded)) == _hash(torch.from_numpy(np.array(decoded)))
    assert from_jpeg != from_png  # JPEG is lossy: other pixels, another hash


def test_one_differing_pixel_changes_the_hash() -> None:
    pixels = _pixels()
    changed = pixels.copy()
    changed[17, 33, 1] ^= 1
    assert _hash(pixels) != _hash(changed)
    assert _hash(Image.fromarray(pixels)) != _hash(Image.fromarray(changed))
    assert _hash(torch.from_numpy(pixels)) != _hash(torch.from_numpy(changed))


def test_layout_and_type_are_part_of_the_content() -> None:
    pixels = _pixels()
    assert _hash(pixels) != _hash(pixels.reshape(64, 48, 3))  # same bytes, other shape
    assert _hash(pixels) != _hash(pixels.astype(np.int16))
    assert _hash(np.asfortranarray(pixels)) == _hash(pixels)  # memory order is not
    assert _hash(pixels.astype(">u2")) == _hash(pixels.astype("<u2"))  # nor byte order
    assert MultiModalHasher.hash_kwargs(image=pixels) != MultiModalHasher.hash_kwargs(video=pixels)
    assert MultiModalHasher.hash_kwargs(a=True) != MultiModalHasher.hash_kwargs(a=1)
    bf16 = torch.arange(6, dtype=torch.bfloat16)
    assert _hash(bf16) != _hash(bf16.view(torch.int16))


def test_palette_images_hash_as_their_pixels() -> None:
    rgb = Image.fromarray(_pixels(1)[:, :, :3])
    palette = rgb.quantize(colors=16)
    assert palette.mode == "P"
    assert _hash(palette) == _hash(palette.convert("RGB"))
    assert _hash(palette) != _hash(np.asarray(palette))  # indices are not pixels


def test_items_and_kwargs() -> None:
    a, b = _pixels(2), _pixels(3)
    hashes = MultiModalHasher.hash_items("image", [a, b, a])
    assert hashes[0] == hashes[2] != hashes[1]
    assert MultiModalHasher.hash_kwargs(x=1, y=a) == MultiModalHasher.hash_kwargs(y=a, x=1)


def test_values_without_a_canonical_form_are_refused() -> None:
    with pytest.raises(ValueError, match="type object"):
        _hash(object())
    with pytest.raises(ValueError, match="Python objects"):
        _hash(np.array([object()]))
