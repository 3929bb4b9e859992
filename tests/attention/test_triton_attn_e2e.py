"""Tiny random Llama and Gemma 3 end to end through the TRITON attention backend
(forced with KVSERVE_ATTENTION_BACKEND; on a machine without a GPU its kernels run under
Triton's interpreter): greedy tokens equal transformers'. The Gemma 3 model has
sliding-window and global layers and soft-capped scores; block size 4 and a 16-token
budget give chunked prefills, decodes and null blocks in the same steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from kvserve.attention.layer import get_attention_layers
from kvserve.entrypoints.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.entrypoints.test_llm_tiny_models import CORPUS, build_model, hf_greedy
from tests.model_executor.test_attention_variant_models import BUILDERS
from tests.reference import assert_no_leak

MAX_TOKENS = 8


def _backends(worker: Any) -> list[str]:
    layers = get_attention_layers(worker.model_runner.model)
    return sorted({layer.backend.get_name() for layer in layers.values()})


def _run(path: Path, prompts: list[list[int]], **kwargs: Any) -> list[list[int]]:
    llm: Any = LLM(
        str(path), block_size=4, max_num_batched_tokens=16, kv_cache_memory=4 << 20, **kwargs
    )
    try:
        assert llm.collective_rpc(_backends) == [["TRITON"]]
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert_no_leak(llm)
        return [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", "TRITON")


def test_tiny_llama_matches_transformers(tmp_path: Path) -> None:
    reference = build_model("llama", tmp_path)
    tokenizer = reference_tokenizer(tmp_path)
    prompts = [tokenizer.encode(text) for text in CORPUS[:2]]
    prompts.append(prompts[0] + prompts[1])  # a prefix hit: the chunk after cached blocks
    got = _run(tmp_path, prompts)
    assert got == [hf_greedy(reference, p, MAX_TOKENS) for p in prompts]


def test_tiny_gemma3_matches_transformers(tmp_path: Path) -> None:
    torch.manual_seed(7)
    hf = BUILDERS["gemma3"]().eval()
    hf.save_pretrained(tmp_path)
    # test_attention_variant_models' prompts: the window and the soft-cap change their
    # continuations (that test checks it), so the backend's variants are exercised.
    torch.manual_seed(11)
    prompts = [torch.randint(3, 256, (n,)).tolist() for n in (40, 27)]
    with torch.inference_mode():
        expected = [
            hf.generate(
                torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                do_sample=False, eos_token_id=None, pad_token_id=0,
            )[0, len(p) :].tolist()
            for p in prompts
        ]  # fmt: skip
    # The tokenizer only detokenizes; SmolLM2's has every id below the vocabulary's 256.
    got = _run(tmp_path, prompts, tokenizer="SmolLM2-135M-Instruct", enable_prefix_caching=False)
    assert got == expected


def reference_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
