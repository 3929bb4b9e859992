"""Decode tok/s of a Bamba-style Mamba-2 hybrid (2 of 8 layers attention) against the
same model with every layer attention, at 512 and 8,192 tokens of context, on this
CPU. Random weights (speed does not depend on them). Not a test: run it by hand,
``python tests/benchmarks/mamba_decode_speed.py [context lengths...]``."""

import sys
from pathlib import Path

import torch
import transformers as tf

from kvserve.entrypoints.llm import LLM
from kvserve.sampling_params import SamplingParams


def build(kind: str, path: Path) -> None:
    torch.manual_seed(0)
    attn = [3, 7] if kind == "hybrid" else list(range(8))
    cfg = tf.BambaConfig(
        vocab_size=1000,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        attn_layer_indices=attn,
        mamba_n_heads=16,
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


def main() -> None:
    ctx_lens = [int(x) for x in sys.argv[1:]] or [512, 8192]
    for kind in ("hybrid", "attention"):
        path = Path(f"/tmp/mamba_bench/{kind}")
        if not path.exists():
            build(kind, path)
        llm = LLM(
            str(path),
            skip_tokenizer_init=True,
            max_num_batched_tokens=2048,
            max_model_len=8192 + 128,
        )
        warm = [int(t) for t in torch.randint(3, 1000, (64,))]
        llm.generate(
            {"prompt_token_ids": warm},
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
            use_tqdm=False,
        )
        for ctx in ctx_lens:
            prompt = [int(t) for t in torch.randint(3, 1000, (ctx,))]
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
