"""Content hashes of multimodal items: the same pixels hash alike, whatever held them.

A hash keys every cache an item passes through (processed inputs, encoder outputs,
prefix-cache blocks), so it must depend on the content alone: a PNG, the lossless copy of
a decoded JPEG, a numpy array and a torch tensor holding equal pixels give one hash, and
one differing pixel gives another. Each value is reduced to a canonical array (its
element type by name, shape, C-order bytes) and fed to BLAKE3 with a tag of its kind;
images become their pixel array first, palette and other non-pixel modes converted to
RGB (RGBA where they carry transparency). Nothing is pickled: a value of a type not
listed here is a ValueError, not a hash of its repr.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from blake3 import blake3
from PIL import Image

# Pillow modes whose np.asarray is the pixels themselves; others (P, CMYK, YCbCr, ...)
# hold indices or another colour space and are converted first.
_PIXEL_MODES = frozenset({"1", "L", "LA", "RGB", "RGBA", "I", "I;16", "F"})


def _image_pixels(image: Image.Image) -> np.ndarray:
    if image.mode not in _PIXEL_MODES:
        transparent = image.mode in ("PA", "RGBa", "La") or "transparency" in image.info
        image = image.convert("RGBA" if transparent else "RGB")
    return np.asarray(image)


def _tensor_array(value: Any, torch: Any) -> tuple[np.ndarray, str]:
    tensor = value.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:  # no numpy type: hash its bits under its own name
        return tensor.view(torch.int16).numpy(), "bfloat16"
    array = tensor.numpy()
    return array, array.dtype.name


class MultiModalHasher:
    """BLAKE3 over a canonical serialisation (vLLM's ``MultiModalHasher``)."""

    @classmethod
    def _feed(cls, h: Any, value: object) -> None:
        if isinstance(value, Image.Image):
            value = _image_pixels(value)
        torch = sys.modules.get("torch")  # a tensor can only exist once torch is loaded
        if isinstance(value, np.ndarray) or (torch is not None and isinstance(value, torch.Tensor)):
            if isinstance(value, np.ndarray):
                array, dtype = value, value.dtype.name
            else:
                array, dtype = _tensor_array(value, torch)
            if array.dtype.hasobject:
                raise ValueError("cannot hash a numpy array of Python objects")
            array = np.ascontiguousarray(array)
            if array.dtype.byteorder == ">":
                array = array.astype(array.dtype.newbyteorder("<"))
            h.update(f"array:{dtype}:{array.shape}:".encode())
            h.update(array.tobytes() if array.ndim == 0 else array.reshape(-1).view(np.uint8))
        elif isinstance(value, bool | int | float | str | bytes) or value is None:
            # bool before int: True and 1 must differ.
            data = value if isinstance(value, bytes) else repr(value).encode()
            h.update(f"{type(value).__name__}:{len(data)}:".encode())
            h.update(data)
        elif isinstance(value, Mapping):
            h.update(f"dict:{len(value)}:".encode())
            for key in sorted(value, key=str):
                cls._feed(h, str(key))
                cls._feed(h, value[key])
        elif isinstance(value, list | tuple):
            h.update(f"list:{len(value)}:".encode())
            for item in value:
                cls._feed(h, item)
        else:
            raise ValueError(f"cannot hash a multimodal value of type {type(value).__name__}")

    @classmethod
    def hash_kwargs(cls, **kwargs: object) -> str:
        """Hex digest of the keyword arguments (sorted by name) and their values."""
        h = blake3()
        cls._feed(h, kwargs)
        return str(h.hexdigest())

    @classmethod
    def hash_items(cls, modality: str, items: Iterable[object]) -> list[str]:
        """One hash per item of a modality (the modality is part of each)."""
        return [cls.hash_kwargs(**{modality: item}) for item in items]
