"""The on-disk tokenizer cache: reused when whole, rebuilt when stale or damaged."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve.transformers_utils import tokenizer_cache
from kvserve.transformers_utils.model_resolver import resolve_model
from kvserve.transformers_utils.tokenizer import (
    conversion_count,
    forget_loaded_tokenizers,
    get_tokenizer,
)

TEXTS = ["Hello world", "  spaces\tand tabs", "Ünïcödé 日本語 🤖", "<|im_start|>user\nhi<|im_end|>"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty cache, and no tokenizer held in memory, before and after."""
    monkeypatch.setenv("KVSERVE_HOME", str(tmp_path / "cache"))
    forget_loaded_tokenizers()
    yield tmp_path / "cache"
    forget_loaded_tokenizers()


def _fingerprint(tokenizer: object) -> tuple[object, ...]:
    encode = [tokenizer.encode(t) for t in TEXTS]  # type: ignore[attr-defined]
    chat = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)  # type: ignore[attr-defined]
    special = (tokenizer.bos_token, tokenizer.eos_token, tokenizer.all_special_ids)  # type: ignore[attr-defined]
    return encode, chat, special


def test_root_honours_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KVSERVE_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tokenizer_cache.cache_root() == tmp_path / "xdg" / "kvserve"
    monkeypatch.setenv("KVSERVE_HOME", str(tmp_path / "own"))
    assert tokenizer_cache.cache_root() == tmp_path / "own"


def test_second_load_reads_the_cache_instead_of_converting(cache_dir: Path) -> None:
    resolved = resolve_model(None)
    before = conversion_count()
    first = get_tokenizer(resolved)
    assert conversion_count() == before + 1
    entry = tokenizer_cache.entry_dir(resolved.path)
    manifest = json.loads((entry / tokenizer_cache.MANIFEST).read_text())
    assert entry.parent.parent == cache_dir and "tokenizer.json" in manifest["files"]
    forget_loaded_tokenizers()  # as a new process would start
    second = get_tokenizer(resolved)
    assert second is not first and conversion_count() == before + 1
    assert _fingerprint(second) == _fingerprint(first)


def test_damaged_entry_is_rebuilt_never_trusted(cache_dir: Path) -> None:
    resolved = resolve_model(None)
    reference = _fingerprint(get_tokenizer(resolved))
    entry = tokenizer_cache.entry_dir(resolved.path)
    damages = [
        lambda: os.truncate(entry / "tokenizer.json", 1000),
        lambda: (entry / "tokenizer_config.json").write_text("{}"),
        lambda: (entry / tokenizer_cache.MANIFEST).write_text("not json"),
        lambda: (entry / "tokenizer.json").unlink(),
    ]
    for damage in damages:
        damage()
        forget_loaded_tokenizers()
        before = conversion_count()
        assert _fingerprint(get_tokenizer(resolved)) == reference
        assert conversion_count() == before + 1  # converted again, not loaded
        assert tokenizer_cache.lookup(resolved.path) == entry  # and whole again


def test_changed_model_file_gets_a_new_entry(cache_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    shutil.copyfile(resolve_model(None).path, model)
    resolved = resolve_model(str(model))
    get_tokenizer(resolved)
    old_entry = tokenizer_cache.entry_dir(str(model))
    stat = model.stat()
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert tokenizer_cache.entry_dir(str(model)) != old_entry
    assert tokenizer_cache.lookup(str(model)) is None
    forget_loaded_tokenizers()
    before = conversion_count()
    get_tokenizer(resolved)
    assert conversion_count() == before + 1


def test_store_is_atomic_and_checks_identity(cache_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "src.gguf"
    source.write_bytes(b"v1")

    def fail(directory: Path) -> None:
        (directory / "tokenizer.json").write_text("{")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        tokenizer_cache.store(str(source), fail)
    assert tokenizer_cache.lookup(str(source)) is None
    assert not list((cache_dir / "tokenizers").iterdir())  # no half-written entry left

    entry = tokenizer_cache.store(str(source), lambda d: (d / "a.json").write_text("[]"))
    assert tokenizer_cache.lookup(str(source)) == entry
    # A manifest naming another source (e.g. copied from elsewhere) is not trusted.
    manifest = json.loads((entry / tokenizer_cache.MANIFEST).read_text())
    manifest["source"]["size"] += 1
    (entry / tokenizer_cache.MANIFEST).write_text(json.dumps(manifest))
    assert tokenizer_cache.lookup(str(source)) is None and not entry.exists()
