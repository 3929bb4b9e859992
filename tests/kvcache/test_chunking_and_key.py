from __future__ import annotations

import subprocess
import sys

import pytest

from kvserve.kvcache.chunking import ChunkedTokenDatabase
from kvserve.kvcache.key import CacheEngineKey, CacheEngineMetadata

META = CacheEngineMetadata("SmolLM2/135M@q4", world_size=2, worker_id=1)


def test_chunks_are_chained_and_full_only_by_default() -> None:
    db = ChunkedTokenDatabase(META, chunk_size=4)
    tokens = list(range(10))
    full = list(db.chunks(tokens))
    assert [(c.start, c.end) for c in full] == [(0, 4), (4, 8)]
    with_partial = list(db.chunks(tokens, include_partial=True))
    assert [(c.start, c.end) for c in with_partial] == [(0, 4), (4, 8), (8, 10)]
    # A chunk's key depends on every earlier token, not only its own.
    other = list(db.chunks([99, *tokens[1:]]))
    assert other[1].key != full[1].key
    # A short last chunk never shares a key with the full chunk it starts.
    assert list(db.chunks(tokens[:6], include_partial=True))[1].key != full[1].key
    # The seed and the tags change every key.
    assert next(ChunkedTokenDatabase(META, 4, seed=1).chunks(tokens)).key != full[0].key
    assert next(db.chunks(tokens, tags=(("salt", "x"),))).key != full[0].key


def test_chunk_hashes_agree_across_processes() -> None:
    code = (
        "from kvserve.kvcache.chunking import ChunkedTokenDatabase;"
        "from kvserve.kvcache.key import CacheEngineMetadata;"
        "db = ChunkedTokenDatabase(CacheEngineMetadata('m'), 256, seed=7);"
        "print(' '.join(c.key.chunk_hash for c in db.chunks(list(range(1000)))))"
    )
    # Different PYTHONHASHSEEDs: nothing may depend on Python's salted hash().
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": str(s), "PATH": ""},
        ).stdout
        for s in (1, 2)
    }
    db = ChunkedTokenDatabase(CacheEngineMetadata("m"), 256, seed=7)
    here = " ".join(c.key.chunk_hash for c in db.chunks(list(range(1000))))
    assert outs == {here + "\n"}
    assert len(here.split()) == 3


def test_key_string_round_trip() -> None:
    key = CacheEngineKey("org/model@v1", 2, 1, "ab" * 32, "float32", (("lora", "a=b,c"),))
    text = key.to_string()
    assert CacheEngineKey.from_string(text) == key
    plain = CacheEngineKey("m", 1, 0, "cd" * 32, "float16")
    assert plain.to_string() == f"m@1@0@{'cd' * 32}@float16"
    assert CacheEngineKey.from_string(plain.to_string()) == plain
    for bad in ("", "a@b", "m@x@0@h@float32"):
        with pytest.raises(ValueError):
            CacheEngineKey.from_string(bad)
