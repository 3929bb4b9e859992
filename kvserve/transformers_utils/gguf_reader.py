"""A GGUF header reader that parses the whole header in one pass over a memory map.

``gguf.GGUFReader`` builds a numpy memmap view for every part of every field; for a
49k-entry vocabulary that is several hundred thousand tiny views and seconds of start-up.
This reader walks the same layout with ``struct`` and reads numeric arrays with one
``np.frombuffer`` each, so the header of the default model parses in tens of
milliseconds. Tensor data stays in the file: every ``GGUFTensor.data`` is a read-only
numpy view on the memory map, shaped as ``gguf.GGUFReader`` shapes it (raw block bytes
per row for quantized types), so nothing is read until it is used.

Only little-endian files of GGUF versions 2 and 3 are accepted (all llama.cpp writes).
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value type id -> (struct format, numpy dtype) for scalars and numeric arrays.
_SCALARS: dict[int, tuple[str, Any]] = {
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9
# Types stored element by element (everything else is stored as blocks of bytes).
_ELEMENT_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's header entry. ``shape`` is in GGUF order (fastest dimension first);
    ``data`` is a read-only view on the file in torch order, the last axis being bytes
    for block-quantized types."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFFile:
    """The parsed header of one GGUF file plus a memory map of its tensor data.

    ``fields`` maps each metadata key to a Python value: ``str``, ``int``, ``float``,
    ``bool``, a ``list[str]`` for string arrays, or a numpy array for numeric arrays.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # an empty file cannot be mapped
                raise ValueError(f"{path} is not a GGUF file: {e}") from e
        self._pos = 0
        try:
            self.fields, self.tensors = self._parse()
        except (struct.error, UnicodeDecodeError, IndexError) as e:
            raise ValueError(f"{path} is not a valid GGUF file (truncated or corrupt): {e}") from e
        self._by_name = {t.name: t for t in self.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def tensor(self, name: str) -> GGUFTensor | None:
        return self._by_name.get(name)

    # --- parsing -----------------------------------------------------------------------

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._unpack("<Q")
        start = self._pos
        self._pos += length
        if self._pos > len(self._map):
            raise IndexError("string runs past the end of the file")
        return self._map[start : self._pos].decode("utf-8")

    def _value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            item_type, count = self._unpack("<I"), self._unpack("<Q")
            if item_type == _STRING:
                return [self._string() for _ in range(count)]
            if item_type == _ARRAY:
                return [self._value(_ARRAY) for _ in range(count)]
            dtype = np.dtype(_SCALARS[item_type][1])
            array = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos)
            self._pos += count * dtype.itemsize
            return array
        if value_type not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {value_type}")
        value = self._unpack(_SCALARS[value_type][0])
        return bool(value) if value_type == 7 else value

    def _parse(self) -> tuple[dict[str, Any], list[GGUFTensor]]:
        if self._map[:4] != _MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (bad magic)")
        self._pos = 4
        version = self._unpack("<I")
        if version not in (2, 3):
            raise ValueError(
                f"{self.path}: GGUF version {version} is not supported (2 and 3, little-endian)"
            )
        tensor_count, kv_count = self._unpack("<Q"), self._unpack("<Q")
        fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            fields[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            n_dims = self._unpack("<I")
            dims = struct.unpack_from(f"<{n_dims}Q", self._map, self._pos)
            self._pos += 8 * n_dims
            infos.append((name, dims, self._unpack("<I"), self._unpack("<Q")))
        alignment = int(fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{self.path}: general.alignment {alignment} is not a power of two")
        data_start = -(-self._pos // alignment) * alignment
        tensors = [self._tensor(data_start, *info) for info in infos]
        if len({t.name for t in tensors}) != len(tensors):
            raise ValueError(f"{self.path} lists a tensor name twice")
        return fields, tensors

    def _tensor(
        self, data_start: int, name: str, dims: tuple[int, ...], raw_type: int, offset: int
    ) -> GGUFTensor:
        ggml_type = GGMLQuantizationType(raw_type)
        torch_shape = tuple(reversed(dims))
        n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        element_dtype = _ELEMENT_DTYPES.get(ggml_type)
        if element_dtype is not None:
            dtype, count = np.dtype(element_dtype), n_elements
        else:
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
            if torch_shape[-1] % block_size:
                raise ValueError(f"{self.path}: tensor {name} rows are not whole blocks")
            torch_shape = (*torch_shape[:-1], torch_shape[-1] // block_size * type_size)
            dtype, count = np.dtype(np.uint8), n_elements // block_size * type_size
        start = data_start + offset
        if start + count * dtype.itemsize > len(self._map):
            raise ValueError(f"{self.path}: tensor {name} runs past the end of the file")
        data = np.frombuffer(self._map, dtype=dtype, count=count, offset=start)
        return GGUFTensor(name, ggml_type, tuple(int(d) for d in dims), data.reshape(torch_shape))


def file_identity(path: str) -> tuple[str, int, int]:
    """``(absolute path, size, mtime in ns)``: what says a file on disk is unchanged."""
    stat = os.stat(path)
    return os.path.abspath(path), stat.st_size, stat.st_mtime_ns


@functools.lru_cache(maxsize=4)
def _open(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str) -> GGUFFile:
    """The parsed header of ``path``, parsed once per process while the file is
    unchanged (a rewritten file, with a new size or mtime, is parsed again)."""
    return _open(*file_identity(path))
