"""Synthetic benchmark workloads: random prompts, shared-prefix prompts, multi-turn chats.

Every generator is deterministic for a given seed and tokenizer, so two runs (or two
servers) see the same requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class SampleRequest:
    """One benchmark request: its prompt text, token count and how many tokens to ask for."""

    prompt: str
    prompt_len: int
    expected_output_len: int
    prompt_token_ids: list[int] = field(default_factory=list, repr=False)


@dataclass
class Conversation:
    """A multi-turn chat: the user turns are sent one after another, each with the history."""

    user_turns: list[str]
    expected_output_len: int


def _length_range(mean: int, range_ratio: float) -> tuple[int, int]:
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    low = max(1, int(mean * (1 - range_ratio)))
    return low, max(low, int(mean * (1 + range_ratio)))


def _token_pool(tokenizer: Any) -> np.ndarray:
    # Special tokens (<|im_end|>, BOS...) would end or restructure a prompt: leave them out.
    special = set(tokenizer.all_special_ids)
    return np.array([t for t in range(len(tokenizer)) if t not in special], dtype=np.int64)


def _random_text(
    tokenizer: Any, rng: np.random.Generator, pool: np.ndarray, length: int
) -> tuple[str, list[int]]:
    """Text of about ``length`` tokens; decoding then re-encoding can merge a few tokens."""
    ids = rng.choice(pool, size=length).tolist()
    text = tokenizer.decode(ids)
    return text, list(tokenizer.encode(text, add_special_tokens=False))


def sample_random_requests(
    tokenizer: Any,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[SampleRequest]:
    """Prompts of random tokens, lengths uniform in mean * [1 - ratio, 1 + ratio]."""
    rng = np.random.default_rng(seed)
    pool = _token_pool(tokenizer)
    in_low, in_high = _length_range(input_len, range_ratio)
    out_low, out_high = _length_range(output_len, range_ratio)
    in_lens = rng.integers(in_low, in_high + 1, size=num_prompts)
    out_lens = rng.integers(out_low, out_high + 1, size=num_prompts)
    out: list[SampleRequest] = []
    for in_len, out_len in zip(in_lens.tolist(), out_lens.tolist(), strict=True):
        text, ids = _random_text(tokenizer, rng, pool, in_len)
        out.append(SampleRequest(text, len(ids), out_len, ids))
    return out


def sample_shared_prefix_requests(
    tokenizer: Any,
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    num_prefixes: int = 1,
    seed: int = 0,
) -> list[SampleRequest]:
    """Prompts in ``num_prefixes`` groups; each group shares its first ``prefix_len`` tokens
    (what the prefix cache should hit), followed by a random suffix per prompt."""
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be at least 1, got {num_prefixes}")
    rng = np.random.default_rng(seed)
    pool = _token_pool(tokenizer)
    prefixes = [rng.choice(pool, size=prefix_len).tolist() for _ in range(num_prefixes)]
    out: list[SampleRequest] = []
    for i in range(num_prompts):
        # Token ids, not text, are concatenated: the shared part stays token-identical.
        ids = prefixes[i % num_prefixes] + rng.choice(pool, size=suffix_len).tolist()
        text = tokenizer.decode(ids)
        encoded = list(tokenizer.encode(text, add_special_tokens=False))
        out.append(SampleRequest(text, len(encoded), output_len, encoded))
    # Interleave the groups the way they would arrive from several users.
    order = rng.permutation(num_prompts).tolist()
    return [out[i] for i in order]


def sample_multi_turn_conversations(
    tokenizer: Any,
    num_conversations: int,
    num_turns: int,
    input_len: int,
    output_len: int,
    seed: int = 0,
) -> list[Conversation]:
    """Conversations of ``num_turns`` random user turns of ``input_len`` tokens each."""
    if num_turns < 1:
        raise ValueError(f"num_turns must be at least 1, got {num_turns}")
    rng = np.random.default_rng(seed)
    pool = _token_pool(tokenizer)
    return [
        Conversation(
            [_random_text(tokenizer, rng, pool, input_len)[0] for _ in range(num_turns)], output_len
        )
        for _ in range(num_conversations)
    ]
