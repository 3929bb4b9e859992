"""A GGUF that holds a long context, for `kvserve bench long-context`: the model's file
itself where its ``<arch>.context_length`` is long enough, else a copy with that one value
raised (cached under ~/.cache/kvserve/long_context, made once)."""

from __future__ import annotations

import mmap
import os
import shutil
import struct
from pathlib import Path

from kvserve.transformers_utils.gguf_reader import open_gguf

# GGUF value types a context length is written as: type id -> struct format.
_INTEGER_FORMATS = {4: "<I", 5: "<i", 10: "<Q", 11: "<q"}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvserve" / "long_context"


def _context_key(path: str) -> str:
    arch = open_gguf(path).get("general.architecture")
    if arch is None:
        raise ValueError(f"{path}: no general.architecture key")
    return f"{arch}.context_length"


def context_length(path: str) -> int:
    value = open_gguf(path).get(_context_key(path))
    if value is None:
        raise ValueError(f"{path}: no {_context_key(path)} key")
    return int(value)


def gguf_with_context(path: str, positions: int) -> str:
    """``path`` if its model holds ``positions`` positions, else a copy that claims to.

    Only the value changes, in place (a fixed-width integer, so the file's layout stays):
    RoPE past the trained length extrapolates, which leaves a step's speed as it is.
    """
    current = context_length(path)
    if current >= positions:
        return path
    target = cache_dir() / f"{Path(path).stem}.ctx{positions}.gguf"
    if target.exists() and context_length(str(target)) == positions:
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    shutil.copyfile(path, partial)
    key = _context_key(path).encode()
    with open(partial, "r+b") as f, mmap.mmap(f.fileno(), 0) as data:
        # The key/value pair as the header holds it: key length, key, value type, value.
        for type_id, fmt in _INTEGER_FORMATS.items():
            entry = struct.pack("<Q", len(key)) + key + struct.pack("<I", type_id)
            at = data.find(entry + struct.pack(fmt, current))
            if at >= 0:
                start = at + len(entry)
                data[start : start + struct.calcsize(fmt)] = struct.pack(fmt, positions)
                break
        else:
            raise ValueError(f"{path}: {key.decode()} is not stored as an integer")
        data.flush()
    partial.replace(target)  # whole or absent, should two runs race
    return str(target)
