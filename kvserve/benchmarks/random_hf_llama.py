"""A random float32 Llama in HF's format for the parallelism benchmarks (`bench pipeline`,
`bench ubatch`), built with transformers so no download is needed; its size is set by the
benchmark's flags."""

from __future__ import annotations

import argparse


def add_random_model_args(parser: argparse.ArgumentParser, hidden_size: int) -> None:
    parser.add_argument("--hidden-size", type=int, default=hidden_size, help="random model only")
    parser.add_argument("--num-layers", type=int, default=8, help="random model only")
    parser.add_argument("--vocab-size", type=int, default=8000, help="random model only")


def write_random_llama(path: str, args: argparse.Namespace) -> None:
    """The model with room for ``args.prompt_len + args.max_tokens`` positions."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=args.hidden_size,
        intermediate_size=args.hidden_size * 2,
        num_hidden_layers=args.num_layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.prompt_len + args.max_tokens + 64,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).float().save_pretrained(path)


def require_positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(args, name)}")
