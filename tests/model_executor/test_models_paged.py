from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from kvserve.model_executor.model_loader import get_model
from kvserve.transformers_utils.arch_config import load_arch_config
from kvserve.transformers_utils.model_resolver import resolve_model

ATOL = 1e-4


def _load(path: Path) -> torch.nn.Module:
    resolved = resolve_model(str(path))
    assert resolved.format == "hf"
    return get_model(resolved, load_arch_config(resolved))


@torch.no_grad()
def _hf_logits(hf: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_qwen2"])
def test_chunked_prefill_then_decode_matches_hf(
    which: str, request: pytest.FixtureRequest, paged_runner: Callable
) -> None:
    path, hf = request.getfixturevalue(which)
    model = _load(path)
    runner = paged_runner(model, block_size=4)
    torch.manual_seed(2)
    prompt = torch.randint(3, 256, (23,)).tolist()
    ref = _hf_logits(hf, prompt)
    start = 0
    for chunk in (9, 8, 6):  # chunk starts land mid-block: 9 % 4, 17 % 4
        (logits,) = runner.step([("r", prompt[start : start + chunk])])
        torch.testing.assert_close(logits, ref[start : start + chunk], atol=ATOL, rtol=0)
        start += chunk

    tokens = [int(logits[-1].argmax())]
    step_logits = [logits[-1]]
    for _ in range(5):
        (logits,) = runner.step([("r", tokens[-1:])])
        step_logits.append(logits[0])
        tokens.append(int(logits[0].argmax()))

    expected = hf.generate(
        torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(prompt) :].tolist()
    assert tokens == expected
    ref = _hf_logits(hf, prompt + tokens)
    torch.testing.assert_close(
        torch.stack(step_logits), ref[len(prompt) - 1 : -1], atol=ATOL, rtol=0
    )


def test_mixed_batch_decode_and_chunked_prefill(tiny_llama: tuple, paged_runner: Callable) -> None:
    path, hf = tiny_llama
    runner = paged_runner(_load(path), block_size=4)
    torch.manual_seed(3)
    a = torch.randint(3, 256, (10,)).tolist()
    b = torch.randint(3, 256, (15,)).tolist()
    ref_a, ref_b = _hf_logits(hf, [*a, 7, 9]), _hf_logits(hf, [*b, 11])

    la, lb = runner.step([("a", a), ("b", b[:6])])
    torch.testing.assert_close(la, ref_a[:10], atol=ATOL, rtol=0)
    torch.testing.assert_close(lb, ref_b[:6], atol=ATOL, rtol=0)
    # B continues its prefill (cached prefix of 6) while A decodes, B listed first.
    lb, la = runner.step([("b", b[6:]), ("a", [7])])
    torch.testing.assert_close(lb, ref_b[6:15], atol=ATOL, rtol=0)
    torch.testing.assert_close(la, ref_a[10:11], atol=ATOL, rtol=0)
    la, lb = runner.step([("a", [9]), ("b", [11])])  # both decoding: the batched path
    torch.testing.assert_close(la, ref_a[11:12], atol=ATOL, rtol=0)
    torch.testing.assert_close(lb, ref_b[15:16], atol=ATOL, rtol=0)


def test_loaded_model_shape(tiny_qwen2: tuple) -> None:
    path, _ = tiny_qwen2
    assert (path / "model.safetensors.index.json").is_file()  # the sharded path ran
    model = _load(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    layer = model.model.layers[1].self_attn
    assert layer.qkv_proj.bias is not None and layer.o_proj.bias is None
    assert layer.attn.layer_name == "model.layers.1.self_attn.attn"
