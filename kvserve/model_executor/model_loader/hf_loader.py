"""Iterate the tensors of an HF checkpoint directory (single or sharded safetensors)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

_INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors shards, in index order when an index exists."""
    model_dir = Path(model_dir)
    index = model_dir / _INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [model_dir / f for f in dict.fromkeys(weight_map.values())]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights found in {model_dir}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"safetensors shards listed in {index} are missing: {missing}")
    return files


def iterate_safetensors_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` lazily, one shard open at a time (memory-mapped)."""
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
