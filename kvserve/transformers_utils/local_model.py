"""vLLM's loading arguments on local files: revision, download_dir and load_format.

kvserve never downloads, so these pick among files already on disk: ``download_dir`` is a
folder holding the model (as a plain directory, or in the Hugging Face cache layout that
vLLM's downloads leave there), ``revision`` picks a snapshot of a cached model, and
``load_format`` must agree with what the model is.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from kvserve.transformers_utils.model_resolver import ResolvedModel

logger = logging.getLogger(__name__)

# load_format values and the model format each one reads; "auto" reads either.
_LOAD_FORMATS = {"auto": ("hf", "gguf"), "safetensors": ("hf",), "gguf": ("gguf",)}
_NEVER = {
    "pt": "PyTorch .bin checkpoints are pickles, which kvserve never loads; "
    "convert them to safetensors",
    "npcache": "it caches PyTorch .bin (pickle) checkpoints, which kvserve never loads",
    "dummy": "kvserve loads real weights only",
}


def _hub_cache() -> Path:
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit)
    home = os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface"))
    return Path(home) / "hub"


def _snapshot(repo_dir: Path, revision: str | None) -> Path | None:
    """The snapshot of a HF-cache repo folder (models--org--name) for ``revision``."""
    revision = revision or "main"
    ref = repo_dir / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = repo_dir / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def locate_model(model: str | None, revision: str | None, download_dir: str | None) -> str | None:
    """The local path ``model`` names once download_dir/revision are applied.

    A name kvserve knows or an existing path is returned as it is (download_dir does not
    apply to it). Raises ValueError when download_dir/revision name nothing on disk.
    """
    if model is None or (revision is None and download_dir is None):
        return model
    if Path(os.path.expanduser(model)).exists():
        if revision not in (None, "main"):
            logger.warning(
                "revision=%r ignored: %s is a plain local path, not a cached repository",
                revision,
                model,
            )
        return model
    roots = [Path(download_dir)] if download_dir else [_hub_cache()]
    for root in roots:
        plain = root / model
        if plain.exists() and revision in (None, "main"):
            return str(plain)
        snapshot = _snapshot(root / ("models--" + model.replace("/", "--")), revision)
        if snapshot is not None:
            return str(snapshot)
    where = download_dir or str(roots[0])
    if revision is None and download_dir is None:
        return model
    # A known alias (the default model) with only a revision: nothing to pick among.
    raise ValueError(
        f"model {model!r} (revision {revision or 'main'!r}) is not in {where}: kvserve does "
        "not download; download_dir must hold the model as a folder or in the Hugging Face "
        "cache layout (models--ORG--NAME/snapshots/COMMIT)"
    )


def check_load_format(load_format: str, resolved: ResolvedModel) -> None:
    """Raises ValueError unless ``load_format`` reads a model of ``resolved``'s format."""
    if load_format in _NEVER:
        raise ValueError(f"load_format={load_format!r} is not supported: {_NEVER[load_format]}")
    formats = _LOAD_FORMATS.get(load_format)
    if formats is None:
        raise ValueError(
            f"load_format must be one of {', '.join(_LOAD_FORMATS)}, got {load_format!r}"
        )
    if resolved.format not in formats:
        kind = "a GGUF file" if resolved.format == "gguf" else "a safetensors checkpoint"
        raise ValueError(f"load_format={load_format!r}, but {resolved.path} is {kind}")
