"""The parts of a PEFT adapter's ``adapter_config.json`` that decide how it is applied,
read and checked before any weight is (so a bad adapter is refused when it is named)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# HF projection names the LoRA layers wrap (attention and MLP of the Llama family).
SUPPORTED_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


@dataclass(frozen=True)
class PEFTConfig:
    rank: int
    scaling: float  # lora_alpha / r (or / sqrt(r) with rsLoRA)
    target_modules: tuple[str, ...]


def read_peft_config(path: str | Path, max_lora_rank: int | None = None) -> PEFTConfig:
    """Raises ValueError, naming the file, for anything kvserve cannot apply."""
    directory = Path(path)
    config_file = directory / ADAPTER_CONFIG
    if not config_file.is_file():
        raise ValueError(f"no {ADAPTER_CONFIG} in LoRA adapter directory {str(path)!r}")
    if not (directory / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"no {ADAPTER_WEIGHTS} in LoRA adapter directory {str(path)!r}")
    try:
        raw = json.loads(config_file.read_text())
        rank = int(raw["r"])
        alpha = float(raw.get("lora_alpha", rank))
        targets = raw.get("target_modules") or []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot read {config_file}: {exc}") from None
    if isinstance(targets, str):
        raise ValueError(f"{config_file}: target_modules as a regex is not supported")
    unsupported = sorted(set(targets) - set(SUPPORTED_TARGET_MODULES))
    if unsupported or not targets:
        raise ValueError(
            f"{config_file}: target_modules {unsupported or targets} not supported "
            f"(supported: {', '.join(SUPPORTED_TARGET_MODULES)})"
        )
    for key in ("use_dora", "modules_to_save"):
        if raw.get(key):
            raise ValueError(f"{config_file}: {key} is not supported")
    if raw.get("bias", "none") != "none":
        raise ValueError(f"{config_file}: bias={raw['bias']!r} is not supported (only 'none')")
    if max_lora_rank is not None and rank > max_lora_rank:
        raise ValueError(
            f"LoRA adapter rank {rank} is larger than max_lora_rank={max_lora_rank} ({config_file})"
        )
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    return PEFTConfig(rank=rank, scaling=scaling, target_modules=tuple(targets))
