"""An on-disk cache of tokenizers converted from GGUF files.

Converting a GGUF vocabulary into a fast tokenizer costs seconds; loading the converted
``tokenizer.json`` costs a fraction of one. Each entry is a directory named after the
source file's identity (absolute path, size, mtime) holding the files transformers'
``save_pretrained`` wrote plus ``manifest.json``: the identity again and the SHA-256 of
every file. An entry is used only when the manifest parses, names the same identity and
every checksum matches; anything else (a rewritten model file, a truncated or edited
entry, a half-written directory) is removed and rebuilt. Entries are written into a
temporary directory and renamed into place, so a reader never sees a partial one, and
two processes converting at once both end with a whole entry.

Location: ``$KVSERVE_HOME/tokenizers``, else ``$XDG_CACHE_HOME/kvserve/tokenizers``,
else ``~/.cache/kvserve/tokenizers``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvserve.transformers_utils.gguf_reader import file_identity

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
# Bumped when the entry layout or the conversion changes, so old entries are not reused.
_FORMAT = 1


def cache_root() -> Path:
    """The kvserve cache directory (not created here)."""
    # Not KVSERVE_CACHE_DIR: every KVSERVE_CACHE_* variable is a KV tier setting.
    explicit = os.environ.get("KVSERVE_HOME")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvserve"


def _identity(source: str) -> dict[str, object]:
    path, size, mtime_ns = file_identity(source)
    # Another transformers may convert differently: its entries are its own.
    converter = importlib.metadata.version("transformers")
    return {
        "format": _FORMAT,
        "converter": converter,
        "path": path,
        "size": size,
        "mtime_ns": mtime_ns,
    }


def entry_dir(source: str) -> Path:
    """Where the entry for ``source`` (as it is on disk now) lives."""
    identity = _identity(source)
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
    return cache_root() / "tokenizers" / f"{Path(str(identity['path'])).stem}-{digest}"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _is_valid(entry: Path, identity: dict[str, object]) -> bool:
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        files = manifest["files"]
        if manifest.get("source") != identity or not isinstance(files, dict) or not files:
            return False
        return all(
            (entry / name).is_file() and _sha256(entry / name) == digest
            for name, digest in files.items()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def lookup(source: str) -> Path | None:
    """The verified entry directory for ``source``, or None. An entry that fails
    verification is deleted, so the caller rebuilds it."""
    entry = entry_dir(source)
    if not entry.exists():
        return None
    if _is_valid(entry, _identity(source)):
        return entry
    logger.warning("tokenizer cache entry %s is stale or corrupt; rebuilding it", entry)
    shutil.rmtree(entry, ignore_errors=True)
    return None


def store(source: str, write: Callable[[Path], object]) -> Path:
    """Runs ``write(directory)`` into a fresh temporary directory, adds the manifest and
    moves it into place as the entry for ``source``; returns the entry directory."""
    entry = entry_dir(source)
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        write(tmp)
        files = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        manifest = {"source": _identity(source), "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        shutil.rmtree(entry, ignore_errors=True)
        try:
            os.rename(tmp, entry)
        except OSError:
            # Another process renamed its (equally valid) entry in first.
            if not _is_valid(entry, _identity(source)):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return entry
