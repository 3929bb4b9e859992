"""A Qwen3-MoE checkpoint written as GGUF (stacked expert tensors, one of them Q8_0)
loads through the GGUF loader into FusedMoE and matches HF on the same weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType

from kvserve.model_executor.model_loader import get_model
from kvserve.transformers_utils.arch_config import load_arch_config
from kvserve.transformers_utils.model_resolver import resolve_model
from tests.family_models import build_family_model
from tests.model_executor.conftest import gguf_writer

_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _write_qwen3_moe_gguf(hf: torch.nn.Module, path: Path) -> None:
    """llama.cpp's layout: experts stacked per projection; ffn_up_exps stored as Q8_0
    (and the HF reference gets the same rounding)."""
    cfg = hf.config
    w = gguf_writer(path, "qwen3moe", cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    inter = cfg.moe_intermediate_size
    for name, tensor in hf.state_dict().items():
        arr = tensor.float().numpy()
        if not name.startswith("model.layers."):
            w.add_tensor(_GLOBAL_NAMES[name], arr)
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest == "mlp.experts.down_proj":  # HF holds experts stacked: [E, H, I]
            w.add_tensor(f"blk.{layer}.ffn_down_exps.weight", arr)
        elif rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            w.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(arr[:, :inter]))
            up = np.ascontiguousarray(arr[:, inter:])
            q = gguf.quants.quantize(up, GGMLQuantizationType.Q8_0)
            w.add_tensor(f"blk.{layer}.ffn_up_exps.weight", q, raw_dtype=GGMLQuantizationType.Q8_0)
            rounded = gguf.quants.dequantize(q, GGMLQuantizationType.Q8_0).reshape(up.shape)
            with torch.no_grad():
                hf.get_parameter(name)[:, inter:] = torch.from_numpy(rounded)
        else:
            module, kind = rest.rsplit(".", 1)
            w.add_tensor(f"blk.{layer}.{_LAYER_NAMES[module]}.{kind}", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_qwen3_moe_gguf_loads_stacked_experts(tmp_path: Path, paged_runner: Callable) -> None:
    hf = build_family_model("qwen3_moe", tmp_path / "hf")
    path = tmp_path / "tiny-moe.gguf"
    _write_qwen3_moe_gguf(hf, path)
    resolved = resolve_model(str(path))
    arch = load_arch_config(resolved)
    assert arch.architecture == "Qwen3MoeForCausalLM" and arch.qk_norm
    assert arch.moe is not None and (arch.moe.num_experts, arch.moe.top_k) == (8, 2)
    model = get_model(resolved, arch)  # float32 weights
    tokens = torch.randint(3, 160, (13,), generator=torch.Generator().manual_seed(0)).tolist()
    (logits,) = paged_runner(model).step([("r", tokens)])
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)
