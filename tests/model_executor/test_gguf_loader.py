from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from kvserve.attention.backends.registry import get_attn_backend
from kvserve.attention.backends.utils import make_common_attn_metadata
from kvserve.attention.layer import allocate_kv_caches, bind_kv_cache
from kvserve.forward_context import set_forward_context
from kvserve.model_executor.model_loader import get_model
from kvserve.model_executor.model_loader.gguf_loader import gguf_to_hf_name, unpermute_rope_rows
from kvserve.transformers_utils.arch_config import load_arch_config
from kvserve.transformers_utils.model_resolver import resolve_model
from kvserve.transformers_utils.tokenizer import get_tokenizer
from tests.model_executor.conftest import gguf_writer
from tests.reference import hf_reference

_HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (written from its description)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(w, 3), 3), w)


def test_name_mapping() -> None:
    assert gguf_to_hf_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="unexpected GGUF tensor"):
        gguf_to_hf_name("blk.0.mystery.weight")


def _write_tiny_llama_gguf(hf: torch.nn.Module, path: Path) -> None:
    cfg = hf.config
    w = gguf_writer(path, "llama", cfg)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    for name, tensor in hf.state_dict().items():
        arr = tensor.float().numpy()
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{_HF_TO_GGUF[module]}.{kind}"
            if module == "self_attn.q_proj":
                arr = llama_cpp_permute(arr, cfg.num_attention_heads)
            elif module == "self_attn.k_proj":
                arr = llama_cpp_permute(arr, cfg.num_key_value_heads)
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight",
                     "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]  # fmt: skip
        if name.startswith("model.layers.1.mlp."):  # exercise a quantized type too
            q = gguf.quants.quantize(arr, GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_tiny_llama_gguf_matches_dequantized_hf(
    tiny_llama: tuple, tmp_path: Path, paged_runner: Callable
) -> None:
    _, hf = tiny_llama
    path = tmp_path / "tiny.gguf"
    _write_tiny_llama_gguf(hf, path)
    resolved = resolve_model(str(path))
    assert resolved.format == "gguf"
    arch = load_arch_config(resolved)
    assert not arch.tie_word_embeddings and arch.eos_token_ids == (2,)
    assert arch.rope_scaling is None  # the writer above stores plain rope
    model = get_model(resolved, arch)

    # Reference: the HF model with the same Q8_0 rounding, and plain rope.
    ref_model = copy.deepcopy(hf)
    ref_model.config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    ref_model.model.rotary_emb = type(hf.model.rotary_emb)(ref_model.config)
    state = ref_model.state_dict()
    for name, tensor in state.items():
        if name.startswith("model.layers.1.mlp."):
            q = gguf.quants.quantize(tensor.numpy(), GGMLQuantizationType.Q8_0)
            deq = gguf.quants.dequantize(q, GGMLQuantizationType.Q8_0)
            tensor.copy_(torch.from_numpy(deq.reshape(tensor.shape)))

    tokens = torch.randint(3, 256, (13,), generator=torch.Generator().manual_seed(0)).tolist()
    (logits,) = paged_runner(model).step([("r", tokens)])
    with torch.no_grad():
        ref = ref_model(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers() -> None:
    resolved = resolve_model(None)
    arch = load_arch_config(resolved)
    model = get_model(resolved, arch)
    tokenizer = get_tokenizer(resolved)
    ids = tokenizer("The capital of France is Paris. The capital of Italy is").input_ids
    bind_kv_cache(model, allocate_kv_caches(model, 8, 16, "cpu"))
    common = make_common_attn_metadata([len(ids)], [0], [[5, 2]], 16)
    metadata = get_attn_backend("cpu").get_builder_cls()(16, "cpu").build(common)
    with torch.no_grad(), set_forward_context(metadata):
        logits = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))

    hf = hf_reference().model  # transformers' own GGUF loader, float32
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-3, rtol=0)
    assert tokenizer.decode(int(logits[-1].argmax())).strip() == "Rome"
