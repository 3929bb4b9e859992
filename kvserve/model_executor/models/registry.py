"""Architecture name (HF ``config.json`` ``architectures[0]``) -> model class, vLLM's
``ModelRegistry``.

In-tree models are listed as ``"module:Class"`` and imported on first use, so asking
what is supported costs no torch import. A model outside kvserve registers the same
way, before the engine is built::

    import kvserve
    kvserve.ModelRegistry.register_model("MyLlamaForCausalLM", "my_pkg.model:MyLlama")

The class is constructed as ``cls(arch: ArchConfig)`` and must provide what
``LlamaForCausalLM`` does: ``forward(input_ids, positions)`` over the step's flattened
tokens, ``compute_logits(hidden_states)`` and ``load_weights(weights)``, with its
attention through ``kvserve.attention.layer.Attention`` (or ``MLAAttention``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

_PKG = "kvserve.model_executor.models"
_IN_TREE: dict[str, str] = {
    "LlamaForCausalLM": f"{_PKG}.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": f"{_PKG}.qwen2:Qwen2ForCausalLM",
    "MistralForCausalLM": f"{_PKG}.mistral:MistralForCausalLM",
    "Gemma3ForCausalLM": f"{_PKG}.gemma3:Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration": f"{_PKG}.gemma3_mm:Gemma3ForConditionalGeneration",
    "Llama4ForCausalLM": f"{_PKG}.llama4:Llama4ForCausalLM",
    "MixtralForCausalLM": f"{_PKG}.mixtral:MixtralForCausalLM",
    "Qwen3ForCausalLM": f"{_PKG}.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": f"{_PKG}.qwen3:Qwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM": f"{_PKG}.deepseek_v2:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": f"{_PKG}.deepseek_v2:DeepseekV3ForCausalLM",
    "Phi3ForCausalLM": f"{_PKG}.phi3:Phi3ForCausalLM",
    "BertModel": f"{_PKG}.bert:BertModel",
    "Mamba2ForCausalLM": f"{_PKG}.mamba2:Mamba2ForCausalLM",
    "BambaForCausalLM": f"{_PKG}.bamba:BambaForCausalLM",
    "NemotronHForCausalLM": f"{_PKG}.nemotron_h:NemotronHForCausalLM",
    "FalconH1ForCausalLM": f"{_PKG}.falcon_h1:FalconH1ForCausalLM",
    "GraniteMoeHybridForCausalLM": f"{_PKG}.granitemoehybrid:GraniteMoeHybridForCausalLM",
    "WhisperForConditionalGeneration": f"{_PKG}.whisper:WhisperForConditionalGeneration",
}


class _ModelRegistry:
    def __init__(self, models: dict[str, str]) -> None:
        self._models: dict[str, str | type[nn.Module]] = dict(models)

    def register_model(self, model_arch: str, model_cls: str | type[nn.Module]) -> None:
        """Serve ``model_arch`` with ``model_cls`` (a class or ``"pkg.module:Class"``,
        imported when first used); a name already registered is replaced."""
        if not isinstance(model_arch, str) or not model_arch:
            raise ValueError(f"model_arch must be a non-empty string, got {model_arch!r}")
        if isinstance(model_cls, str) and model_cls.count(":") != 1:
            raise ValueError(f"model_cls must look like 'pkg.module:Class', got {model_cls!r}")
        self._models[model_arch] = model_cls

    def out_of_tree_entries(self) -> tuple[tuple[str, str], ...]:
        """``(architecture, "module:Class")`` of every model registered beyond the
        in-tree ones, for processes that start fresh (the engine core) to register too."""
        entries = []
        for arch, target in self._models.items():
            if isinstance(target, str):
                if _IN_TREE.get(arch) != target:
                    entries.append((arch, target))
            elif _IN_TREE.get(arch) != f"{target.__module__}:{target.__qualname__}":
                entries.append((arch, f"{target.__module__}:{target.__qualname__}"))
        return tuple(sorted(entries))

    def get_supported_archs(self) -> list[str]:
        return sorted(self._models)

    def is_supported(self, model_arch: str) -> bool:
        return model_arch in self._models

    def check_supported(self, model_arch: str) -> None:
        """Raises the ValueError that lists every supported architecture."""
        if model_arch not in self._models:
            raise ValueError(
                f"unsupported architecture {model_arch!r} (supported: "
                f"{', '.join(self.get_supported_archs())}; register others with "
                f"kvserve.ModelRegistry.register_model)"
            )

    def resolve_model_cls(self, model_arch: str) -> type[nn.Module]:
        self.check_supported(model_arch)
        target = self._models[model_arch]
        if isinstance(target, str):
            module_name, cls_name = target.split(":")
            try:
                target = getattr(importlib.import_module(module_name), cls_name)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"cannot load model class {target!r} for {model_arch}: {e}") from e
            self._models[model_arch] = target
        return target


ModelRegistry = _ModelRegistry(_IN_TREE)


def get_model_cls(architecture: str) -> type[nn.Module]:
    return ModelRegistry.resolve_model_cls(architecture)


def supported_architectures() -> list[str]:
    return ModelRegistry.get_supported_archs()
