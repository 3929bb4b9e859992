"""A tiny random Llama with fewer KV heads than ranks, as an HF directory and as a GGUF
file of Q8_0 blocks, with transformers' greedy tokens as the reference (shared by the
executor tests)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import gguf
import torch
from gguf import GGMLQuantizationType
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve.entrypoints.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.model_executor.conftest import gguf_writer
from tests.model_executor.test_gguf_loader import _HF_TO_GGUF, llama_cpp_permute

PROMPTS = [[5, 17, 99, 3, 42, 7], [200, 11, 64, 128, 9, 31, 77, 250, 4], [8]]
MAX_TOKENS = 12


def tiny_llama(tied: bool = False) -> LlamaForCausalLM:
    """Tied: the LM head is the embedding, and 255 tokens leave the second of 2 ranks one
    padding row."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,  # fewer than the 2 ranks: replicated
        vocab_size=255 if tied else 256,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return LlamaForCausalLM(config).float().eval()


def write_gguf(hf: LlamaForCausalLM, path: Path) -> LlamaForCausalLM:
    """Every 2-D weight as Q8_0 blocks; returns the HF model holding the same (rounded)
    weights, the reference for the block path."""
    cfg = hf.config
    reference = copy.deepcopy(hf)
    state = reference.state_dict()
    w = gguf_writer(path, "llama", cfg)
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # the file's token_embd serves both
        arr = tensor.float().numpy()
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{_HF_TO_GGUF[module]}.{kind}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight",
                     "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]  # fmt: skip
        if arr.ndim == 2:
            q = gguf.quants.quantize(arr, GGMLQuantizationType.Q8_0)
            deq = gguf.quants.dequantize(q, GGMLQuantizationType.Q8_0).reshape(arr.shape)
            state[name].copy_(torch.from_numpy(deq))
            if name.endswith("q_proj.weight"):
                q = gguf.quants.quantize(
                    llama_cpp_permute(arr, cfg.num_attention_heads), GGMLQuantizationType.Q8_0
                )
            elif name.endswith("k_proj.weight"):
                q = gguf.quants.quantize(
                    llama_cpp_permute(arr, cfg.num_key_value_heads), GGMLQuantizationType.Q8_0
                )
            w.add_tensor(gname, q, raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return reference


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out: list[int] = []
    for _ in range(MAX_TOKENS):
        nxt = int(model(ids).logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def tp_llm(path: str, tp: int, **kwargs: Any) -> LLM:
    return LLM(
        path, skip_tokenizer_init=True, tensor_parallel_size=tp, block_size=4,
        max_num_batched_tokens=16, kv_cache_memory=4 << 20, **kwargs,
    )  # fmt: skip


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def make_checkpoints(root: Path) -> dict[str, Any]:
    hf = tiny_llama()
    hf.save_pretrained(root / "hf")
    gguf_ref = write_gguf(hf, root / "tiny.gguf")
    tied_ref = write_gguf(tiny_llama(tied=True), root / "tiny_tied.gguf")
    return {
        "hf": (str(root / "hf"), hf),
        "gguf": (str(root / "tiny.gguf"), gguf_ref),
        "gguf_tied": (str(root / "tiny_tied.gguf"), tied_ref),
    }
