"""Architecture name (HF ``architectures[0]``) -> model class."""

from __future__ import annotations

from torch import nn

from kvserve.model_executor.models.bert import BertModel
from kvserve.model_executor.models.gemma3 import Gemma3ForCausalLM
from kvserve.model_executor.models.llama import LlamaForCausalLM
from kvserve.model_executor.models.llama4 import Llama4ForCausalLM
from kvserve.model_executor.models.mistral import MistralForCausalLM
from kvserve.model_executor.models.qwen2 import Qwen2ForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Llama4ForCausalLM": Llama4ForCausalLM,
    "BertModel": BertModel,
}


def get_model_cls(architecture: str) -> type[nn.Module]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r} (supported: {', '.join(sorted(_MODELS))})"
        ) from None


def supported_architectures() -> list[str]:
    return sorted(_MODELS)
