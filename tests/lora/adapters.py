"""Tiny random PEFT adapters on the tiny random Llama of test_llm_tiny_models (built in tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.entrypoints.test_llm_tiny_models import build_model

# (rank, alpha, target modules): the first adapter covers attention and MLP, the second
# a subset with another rank, so padding and partial targets are exercised.
ADAPTERS = {
    "alpha": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "beta": (4, 4, ["q_proj", "v_proj", "down_proj"]),
}


def build_base_and_adapters(directory: Path) -> tuple[Any, dict[str, Path]]:
    """Saves the tiny Llama under directory/base and each adapter under directory/<name>;
    returns the HF base model and the adapter paths."""
    from peft import LoraConfig, get_peft_model

    base = build_model("llama", directory / "base")
    paths: dict[str, Path] = {}
    for seed, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + seed)
        config = LoraConfig(
            r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False
        )
        peft_model = get_peft_model(build_model("llama", directory / "scratch"), config)
        with torch.no_grad():  # large enough to change greedy tokens
            for param_name, param in peft_model.named_parameters():
                if "lora_" in param_name:
                    param.normal_(0.0, 0.3)
        paths[name] = directory / name
        peft_model.save_pretrained(paths[name])
    return base, paths


def merged_reference(directory: Path, adapter: Path) -> Any:
    """HF + PEFT with ``adapter`` merged into a fresh copy of the base weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(directory / "base", dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter).merge_and_unload().eval()
