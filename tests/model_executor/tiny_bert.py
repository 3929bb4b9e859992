"""A tiny random BERT sentence encoder saved by sentence-transformers (tests build it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

WORDS = (
    "the quick brown fox jumps over lazy dog a paged kv cache keeps blocks of keys and "
    "values prefix caching shares between requests with same prompt embeddings vectors "
    "cat sat on mat"
).split()


def build_tiny_bert(directory: Path, pooling_mode: str = "mean") -> Any:
    """Saves a random 2-layer BERT with a WordPiece tokenizer and a sentence-transformers
    pooling module (``pooling_mode``: "mean", "cls" or "lasttoken") plus Normalize;
    returns the SentenceTransformer, the reference."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    vocab = directory / "vocab.txt"
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab.write_text("\n".join([*specials, *dict.fromkeys(WORDS)]) + "\n")
    hf_dir = directory / "hf"
    BertTokenizerFast(vocab=str(vocab)).save_pretrained(hf_dir)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(specials) + len(set(WORDS)),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        initializer_range=0.2,
    )
    BertModel(config).eval().save_pretrained(hf_dir)
    transformer = Transformer(str(hf_dir), max_seq_length=128)
    pooling = Pooling(64, pooling_mode=pooling_mode)
    model = SentenceTransformer(modules=[transformer, pooling, Normalize()], device="cpu")
    out = directory / "st"
    model.save(str(out))
    return SentenceTransformer(str(out), device="cpu")
