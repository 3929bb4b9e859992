"""LoRA offline: two PEFT adapters and the base model in one batch, each request's greedy
tokens equal HF + PEFT with its adapter merged; adapters never share prefix-cache blocks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserve.entrypoints.llm import LLM
from kvserve.lora.request import LoRARequest
from kvserve.sampling_params import SamplingParams
from tests.entrypoints.test_llm_tiny_models import CORPUS, hf_greedy
from tests.lora.adapters import build_base_and_adapters, merged_reference
from tests.reference import assert_no_leak

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    directory: Path = tmp_path_factory.mktemp("lora")
    base, paths = build_base_and_adapters(directory)
    references = {None: base, **{n: merged_reference(directory, p) for n, p in paths.items()}}
    loras = {n: LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(paths.items())}
    llm = LLM(
        str(directory / "base"),
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        block_size=4,
        max_num_batched_tokens=32,
        kv_cache_memory=8 << 20,
    )
    yield {"dir": directory, "refs": references, "loras": loras, "llm": llm}
    llm.llm_engine.shutdown()


def _prompts(llm: LLM, count: int) -> list[list[int]]:
    return [llm.get_tokenizer().encode(text) for text in CORPUS[:count]]


def test_base_and_two_adapters_in_one_batch_match_merged_hf(setup: dict[str, Any]) -> None:
    llm, loras, refs = setup["llm"], setup["loras"], setup["refs"]
    choices: list[LoRARequest | None] = [None, loras["alpha"], loras["beta"]]
    batch = [(p, lora) for p in _prompts(llm, 3) for lora in choices]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p, _ in batch],
        GREEDY,
        lora_request=[lora for _, lora in batch],
        use_tqdm=False,
    )
    distinct = set()
    for (prompt, lora), output in zip(batch, outputs, strict=True):
        expected = hf_greedy(refs[lora.lora_name if lora else None], prompt, 12)
        assert list(output.outputs[0].token_ids) == expected, lora
        distinct.add(tuple(expected))
    assert len(distinct) == len(batch), "each adapter must change the tokens"
    assert_no_leak(llm)


def test_adapters_never_share_prefix_blocks(setup: dict[str, Any]) -> None:
    llm, loras = setup["llm"], setup["loras"]
    prompt = {"prompt_token_ids": _prompts(llm, 4)[3] * 2}
    first = llm.generate(prompt, GREEDY, lora_request=loras["alpha"], use_tqdm=False)[0]
    again = llm.generate(prompt, GREEDY, lora_request=loras["alpha"], use_tqdm=False)[0]
    other = llm.generate(prompt, GREEDY, lora_request=loras["beta"], use_tqdm=False)[0]
    base = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0, "the same adapter reuses its own blocks"
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert other.outputs[0].token_ids != first.outputs[0].token_ids
    assert_no_leak(llm)


def test_more_adapters_than_slots_wait_their_turn(setup: dict[str, Any]) -> None:
    """max_loras=1: the scheduler never runs two adapters in a step; both still match."""
    loras, refs = setup["loras"], setup["refs"]
    llm = LLM(
        str(setup["dir"] / "base"),
        enable_lora=True,
        max_loras=1,
        max_lora_rank=8,
        kv_cache_memory=8 << 20,
    )
    try:
        prompts = _prompts(llm, 2)
        order = [loras["alpha"], loras["beta"], None, loras["beta"]]
        outputs = llm.generate(
            [{"prompt_token_ids": prompts[i % 2]} for i in range(4)],
            GREEDY,
            lora_request=order,
            use_tqdm=False,
        )
        for i, (lora, output) in enumerate(zip(order, outputs, strict=True)):
            reference = refs[lora.lora_name if lora else None]
            assert list(output.outputs[0].token_ids) == hf_greedy(reference, prompts[i % 2], 12)
        assert_no_leak(llm)
    finally:
        llm.llm_engine.shutdown()


def test_bad_lora_requests_raise_value_errors(setup: dict[str, Any], tmp_path: Path) -> None:
    llm = setup["llm"]
    with pytest.raises(ValueError, match=r"adapter_config\.json"):
        llm.generate("the fox", GREEDY, lora_request=LoRARequest("x", 9, str(tmp_path)))
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, str(tmp_path))
    small = LLM(
        str(setup["dir"] / "base"), enable_lora=True, max_lora_rank=4, kv_cache_memory=8 << 20
    )
    try:
        with pytest.raises(ValueError, match="max_lora_rank"):
            small.generate("the fox", GREEDY, lora_request=setup["loras"]["alpha"])
    finally:
        small.llm_engine.shutdown()
    assert llm.generate("the fox", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert_no_leak(llm)


def test_lora_needs_enable_lora(tmp_path: Path, setup: dict[str, Any]) -> None:
    plain = LLM(str(setup["dir"] / "base"), kv_cache_memory=8 << 20)
    try:
        with pytest.raises(ValueError, match="enable_lora"):
            plain.generate("the fox", GREEDY, lora_request=setup["loras"]["alpha"])
    finally:
        plain.llm_engine.shutdown()


def test_adapter_on_the_gguf_default_model_matches_peft(llm_factory: Any, tmp_path: Path) -> None:
    """SmolLM2 runs its GGUF blocks (lossless) under the wrappers; an adapter built with
    peft on HF's copy of the same weights gives the same greedy tokens."""
    import torch
    from peft import LoraConfig, get_peft_model

    from tests.reference import hf_reference

    ref = hf_reference()
    torch.manual_seed(0)
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
        init_lora_weights=False,
    )
    peft_model = get_peft_model(ref.model, config)
    try:
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.normal_(0.0, 0.05)
        peft_model.save_pretrained(tmp_path / "adapter")
        prompt = ref.tokenizer("The capital of France is")["input_ids"]
        expected = hf_greedy(peft_model.eval(), prompt, 8)
    finally:
        peft_model.unload()  # the shared HF reference gets its plain modules back
    llm = llm_factory(enable_lora=True, max_lora_rank=8)
    assert llm.llm_engine.config.model_config.quantization == "gguf"
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    lora = LoRARequest("smol", 1, str(tmp_path / "adapter"))
    output = llm.generate({"prompt_token_ids": prompt}, params, lora_request=lora, use_tqdm=False)
    base = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert list(output[0].outputs[0].token_ids) == expected
    assert base[0].outputs[0].token_ids != output[0].outputs[0].token_ids
    assert_no_leak(llm)
