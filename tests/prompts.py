"""A fixed, varied prompt set: raw text and chat, a few tokens up to about 560."""

from __future__ import annotations

from typing import Any

# 16 items: the inventory prompt is ~560 tokens, long enough for several chunks of a
# 64-token step budget and for decode attention's split-K to cut its context in two (at
# 512 tokens and up) from its first decode step, which is what the tests that run it
# need; every prefill of it is a test's largest cost, and at 31 items (~1,040 tokens)
# the prompt set cost the suite about twice the CPU.
_FACTS = " ".join(
    f"Item {i}: the {['red', 'green', 'blue', 'amber'][i % 4]} box on shelf {i % 7} holds "
    f"{i * 3 % 11} apples and {i * 5 % 13} pears, and it was last checked on day {i * 7 % 31}."
    for i in range(1, 17)
)

RAW_PROMPTS = [
    "Hello",
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Photosynthesis is the process by which green plants and some other organisms use "
    "sunlight to synthesize foods from carbon dioxide and water. In plants, photosynthesis "
    "generally involves the green pigment chlorophyll and generates oxygen as a byproduct. "
    "The process takes place mainly in the leaves. Explain, step by step, why",
]

CHAT_PROMPTS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Write a haiku about the sea."},
    ],
    [
        {
            "role": "user",
            "content": "Read this inventory and answer.\n"
            + _FACTS
            + "\nWhich shelf holds item 12, and how many apples are in it?",
        }
    ],
]


def chat_to_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def all_prompt_ids(tokenizer: Any) -> list[list[int]]:
    """Token ids of every prompt, raw ones tokenized as the engine tokenizes text."""
    raw = [list(tokenizer.encode(p)) for p in RAW_PROMPTS]
    return raw + [chat_to_ids(tokenizer, m) for m in CHAT_PROMPTS]
