"""A byte-level BPE tokenizer for tiny random test models (no hub): the model's special
tokens first, then the 256 byte pieces, then filler pieces up to the vocabulary size, so
that every id a random model samples detokenizes."""

from __future__ import annotations

from typing import Any


def byte_level_tokenizer(specials: list[str], vocab_size: int, **special_tokens: Any) -> Any:
    """``special_tokens``: PreTrainedTokenizerFast's keywords (bos_token, chat_template...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = specials + sorted(pre_tokenizers.ByteLevel.alphabet())
    pieces += [f"<u{i}>" for i in range(vocab_size - len(pieces))]
    vocab = {t: i for i, t in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **special_tokens)
