"""The architecture registry: an out-of-tree model registered from this module runs
through ``LLM``; an unsupported architecture fails with the supported list."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

import kvserve
from kvserve.entrypoints.llm import LLM
from kvserve.model_executor.models.llama import LlamaForCausalLM
from kvserve.model_executor.models.registry import ModelRegistry, get_model_cls
from kvserve.sampling_params import SamplingParams
from kvserve.transformers_utils.arch_config import ArchConfig
from tests.family_models import hf_greedy
from tests.model_executor.conftest import make_tiny_llama

OUT_OF_TREE = "TinyOutOfTreeForCausalLM"


class OutOfTreeLlama(LlamaForCausalLM):
    """A model kvserve does not ship: Llama's layers under another architecture name,
    counting its instances so the test sees that this class is the one that ran."""

    instances: ClassVar[list[OutOfTreeLlama]] = []

    def __init__(self, arch: ArchConfig, prefix: str = "") -> None:
        super().__init__(arch, prefix)
        OutOfTreeLlama.instances.append(self)


def _retagged_llama(path: Path, architecture: str) -> Any:
    reference = make_tiny_llama(path)
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = [architecture]
    config_path.write_text(json.dumps(config))
    return reference


def test_top_level_export_is_the_registry() -> None:
    assert kvserve.ModelRegistry is ModelRegistry
    supported = ModelRegistry.get_supported_archs()
    for arch in ("LlamaForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM",
                 "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Phi3ForCausalLM"):  # fmt: skip
        assert arch in supported


def test_out_of_tree_model_runs_through_llm(tmp_path: Path) -> None:
    reference = _retagged_llama(tmp_path, OUT_OF_TREE)
    kvserve.ModelRegistry.register_model(OUT_OF_TREE, f"{__name__}:OutOfTreeLlama")
    try:
        assert get_model_cls(OUT_OF_TREE) is OutOfTreeLlama
        OutOfTreeLlama.instances.clear()
        llm = LLM(str(tmp_path), skip_tokenizer_init=True, block_size=4)
        try:
            prompt = list(range(5, 30))
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            [out] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
            assert len(OutOfTreeLlama.instances) == 1
            assert list(out.outputs[0].token_ids) == hf_greedy(reference, prompt, 8)
        finally:
            llm.llm_engine.shutdown()
    finally:
        ModelRegistry._models.pop(OUT_OF_TREE, None)


def test_out_of_tree_model_runs_in_an_engine_core_process(tmp_path: Path) -> None:
    """The engine core process starts fresh (spawn): the registration travels in the
    config and the worker registers it there too (the name exists nowhere else)."""
    reference = _retagged_llama(tmp_path, OUT_OF_TREE)
    kvserve.ModelRegistry.register_model(OUT_OF_TREE, OutOfTreeLlama)
    try:
        assert (OUT_OF_TREE, f"{__name__}:OutOfTreeLlama") in ModelRegistry.out_of_tree_entries()
        llm = LLM(str(tmp_path), skip_tokenizer_init=True, block_size=4, multiprocess_mode=True)
        try:
            prompt = list(range(7, 31))
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            [out] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
            assert list(out.outputs[0].token_ids) == hf_greedy(reference, prompt, 8)
        finally:
            llm.llm_engine.shutdown()
    finally:
        ModelRegistry._models.pop(OUT_OF_TREE, None)
    assert not ModelRegistry.out_of_tree_entries()


def test_unsupported_architecture_lists_the_supported_ones(tmp_path: Path) -> None:
    _retagged_llama(tmp_path, "GPT2LMHeadModel")
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'") as info:
        LLM(str(tmp_path), skip_tokenizer_init=True)
    message = str(info.value)
    assert "LlamaForCausalLM" in message and "DeepseekV2ForCausalLM" in message
    assert "register_model" in message


def test_register_model_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match=r"pkg\.module:Class"):
        ModelRegistry.register_model("X", "no_colon_here")
    with pytest.raises(ValueError, match="non-empty"):
        ModelRegistry.register_model("", OutOfTreeLlama)
    ModelRegistry.register_model("BrokenForCausalLM", "tests.no_such_module:Model")
    try:
        with pytest.raises(ValueError, match="cannot load model class"):
            get_model_cls("BrokenForCausalLM")
    finally:
        ModelRegistry._models.pop("BrokenForCausalLM", None)
    assert torch.get_default_dtype() == torch.float32
