"""The one-pass GGUF header reader agrees with gguf.GGUFReader and rejects broken files."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from kvserve.transformers_utils.gguf_reader import GGUFFile, open_gguf
from kvserve.transformers_utils.model_resolver import resolve_model


@pytest.fixture(scope="module")
def model_path() -> str:
    return resolve_model(None).path


def test_matches_gguf_reader_on_the_default_model(model_path: str) -> None:
    reference = gguf.GGUFReader(model_path)
    ours = GGUFFile(model_path)
    keys = [k for k in reference.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    for key in keys:
        value = ours.fields[key]
        expected = reference.fields[key].contents()
        assert (value.tolist() if isinstance(value, np.ndarray) else value) == expected, key
    assert len(ours.tensors) == len(reference.tensors) == 272
    for i, (theirs, mine) in enumerate(zip(reference.tensors, ours.tensors, strict=True)):
        assert (mine.name, mine.tensor_type) == (theirs.name, theirs.tensor_type)
        assert mine.shape == tuple(int(d) for d in theirs.shape)
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert not mine.data.flags.writeable  # a view on the read-only map, not a copy
        if i % 8 == 0 or i == len(ours.tensors) - 1:  # bytes: a sample, the last one too
            assert np.array_equal(mine.data, theirs.data), mine.name


def test_parsed_once_per_unchanged_file(model_path: str, tmp_path: Path) -> None:
    assert open_gguf(model_path) is open_gguf(model_path)
    copy = tmp_path / "m.gguf"
    copy.write_bytes(Path(model_path).read_bytes()[: 4 << 20])  # header + some tensors
    with pytest.raises(ValueError, match="runs past the end"):
        open_gguf(str(copy))
    os.truncate(copy, 64 << 10)  # inside the vocabulary
    with pytest.raises(ValueError, match="truncated or corrupt"):
        open_gguf(str(copy))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "not a GGUF file"),
        (b"GGML" + bytes(20), "bad magic"),
        (b"GGUF\x01\0\0\0", "version 1"),
    ],
)
def test_rejects_what_is_not_gguf(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        GGUFFile(str(path))
