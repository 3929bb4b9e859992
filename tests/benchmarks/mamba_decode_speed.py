"""Decode tok/s of a Bamba-style Mamba-2 hybrid (2 of 8 layers attention) against the
same model with every layer attention, at 512 and 8,192 tokens of context, on this
CPU. Random weights (speed does not depend on them). Not a test: run it by hand,
``python tests/benchmarks/mamba_decode_speed.py [--preset 25m|130m] [context lengths...]``
(130m: hidden 768, 12 layers, 3 of them attention, a 32k vocabulary)."""

import argparse
from pathlib import Path

import torch
import transformers as tf
from safetensors import safe_open

from kvserve.entrypoints.llm import LLM
from kvserve.sampling_params import SamplingParams

# hidden, intermediate, layers, attention heads, Mamba heads, vocabulary
_PRESETS = {"25m": (512, 1024, 8, 8, 16, 1000), "130m": (768, 2048, 12, 12, 24, 32000)}


def build(kind: str, preset: str, path: Path) -> None:
    torch.manual_seed(0)
    hidden, inter, layers, heads, mamba_heads, vocab = _PRESETS[preset]
    attn = [i for i in range(layers) if kind != "hybrid" or i % 4 == 3]
    cfg = tf.BambaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=4,
        attn_layer_indices=attn,
        mamba_n_heads=mamba_heads,
        mamba_d_head=64,
        mamba_n_groups=1,
        mamba_d_state=64,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=256,
        max_position_embeddings=16384,
        tie_word_embeddings=False,
    )
    tf.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(path)


def num_parameters(path: Path) -> int:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return sum(torch.Size(f.get_slice(name).get_shape()).numel() for name in f.keys())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", choices=sorted(_PRESETS), default="25m")
    parser.add_argument("context", type=int, nargs="*", default=[512, 8192])
    args = parser.parse_args()
    ctx_lens, vocab = args.context, _PRESETS[args.preset][-1]
    for kind in ("hybrid", "attention"):
        path = Path(f"/tmp/mamba_bench/{args.preset}-{kind}")
        if not path.exists():
            build(kind, args.preset, path)
        print(f"{kind}: {num_parameters(path) / 1e6:.0f}M parameters", flush=True)
        llm = LLM(
            str(path),
            skip_tokenizer_init=True,
            max_num_batched_tokens=2048,
            max_model_len=8192 + 128,
        )
        warm = [int(t) for t in torch.randint(3, vocab, (64,))]
        llm.generate(
            {"prompt_token_ids": warm},
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
            use_tqdm=False,
        )
        for ctx in ctx_lens:
            prompt = [int(t) for t in torch.randint(3, vocab, (ctx,))]
            pn = SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True)
            llm.reset_prefix_cache()
            out = llm.generate({"prompt_token_ids": prompt}, pn, use_tqdm=False)[0]
            m = out.metrics
            print(
                f"{kind} ctx={ctx}: prefill {m.first_token_time - m.arrival_time:.2f}s, "
                f"decode {64 / (m.finished_time - m.first_token_time):.1f} tok/s",
                flush=True,
            )
        llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
