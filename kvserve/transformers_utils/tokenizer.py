"""Tokenizer loading for local models (HF directories and GGUF files), never online.

A GGUF file carries its vocabulary as metadata, not as a ``tokenizer.json``; converting
it takes seconds, so the converted tokenizer is kept on disk (``tokenizer_cache``) and
every later process loads the saved files instead. transformers is imported only when a
tokenizer is first built, so processes that never tokenize (the engine core) skip it.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.transformers_utils import tokenizer_cache
from kvserve.transformers_utils.model_resolver import ResolvedModel
from kvserve.utils.startup import startup_phase

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_conversions = 0


def conversion_count() -> int:
    """How many GGUF tokenizers this process has converted (cache misses)."""
    return _conversions


def _convert_gguf(path: Path) -> PreTrainedTokenizerBase:
    global _conversions
    from transformers import TokenizersBackend

    # The class's own from_pretrained, not AutoTokenizer's: AutoTokenizer first rebuilds
    # the model config from the GGUF with gguf.GGUFReader (seconds) only to pick this
    # class; the vocabulary itself goes through transformers' GGUF tokenizer converter.
    tokenizer = TokenizersBackend.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True
    )
    _conversions += 1
    return tokenizer


def _load_gguf(path: Path) -> PreTrainedTokenizerBase:
    from transformers import TokenizersBackend

    entry = tokenizer_cache.lookup(str(path))
    if entry is not None:
        with startup_phase("tokenizer (cached)", source=str(entry)):
            return TokenizersBackend.from_pretrained(str(entry), local_files_only=True)
    with startup_phase("tokenizer (converted from GGUF)", source=str(path)):
        tokenizer = _convert_gguf(path)
    try:
        tokenizer_cache.store(str(path), lambda d: tokenizer.save_pretrained(str(d)))
    except OSError as e:  # a read-only or full cache only costs the next start its speed
        logger.warning("could not cache the tokenizer of %s: %s", path, e)
    return tokenizer


@functools.lru_cache(maxsize=8)
def _load(tokenizer_path: str, is_gguf: bool) -> PreTrainedTokenizerBase:
    if is_gguf:
        return _load_gguf(Path(tokenizer_path))
    from transformers import AutoTokenizer

    # local_files_only keeps transformers off the Hub even when HF_HUB_OFFLINE is unset.
    with startup_phase("tokenizer", source=tokenizer_path):
        return AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)


def get_tokenizer(resolved: ResolvedModel) -> PreTrainedTokenizerBase:
    """The tokenizer for ``resolved``, shared (cached) across callers in this process."""
    is_gguf = resolved.tokenizer_path.endswith(".gguf")
    return _load(resolved.tokenizer_path, is_gguf)


def forget_loaded_tokenizers() -> None:
    """Drop this process's loaded tokenizers, so the next call reads the disk cache."""
    _load.cache_clear()
