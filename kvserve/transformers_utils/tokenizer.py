"""Tokenizer loading for local models (HF directories and GGUF files), never online."""

from __future__ import annotations

import functools
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvserve.transformers_utils.model_resolver import ResolvedModel


@functools.lru_cache(maxsize=8)
def _load(tokenizer_path: str, is_gguf: bool) -> PreTrainedTokenizerBase:
    # local_files_only keeps transformers off the Hub even when HF_HUB_OFFLINE is unset.
    if is_gguf:
        path = Path(tokenizer_path)
        # Rebuilding a tokenizer from GGUF metadata takes seconds, hence the cache.
        return AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
    return AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)


def get_tokenizer(resolved: ResolvedModel) -> PreTrainedTokenizerBase:
    """The tokenizer for ``resolved``, shared (cached) across callers in this process."""
    is_gguf = resolved.tokenizer_path.endswith(".gguf")
    return _load(resolved.tokenizer_path, is_gguf)
