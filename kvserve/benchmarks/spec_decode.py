"""`kvserve bench spec-decode`: speculative methods on an agentic, code-editing-shaped
workload and on plain chat, greedy: acceptance rate, mean accepted length, output tok/s.

The agentic workload runs in rounds, as an agent loop would: (1) edit code given in the
prompt (the answer repeats most of it), (2) the same conversations one turn later, the
first answer in the history and a request to restate it with a change, (3) the first
round's requests again (an agent retrying a call: the answer repeats an earlier output
that no prompt holds). Plain chat is short creative prompts. Every method must return the
no-speculation tokens; the benchmark checks that too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

from kvserve.args.engine_args import EngineArgs
from kvserve.sampling_params import SamplingParams

METHODS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
}

_CODE = [
    "def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n"
    "        subtotal += item.price * item.quantity\n    tax = subtotal * tax_rate\n"
    "    return subtotal + tax\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    "        self.items.append(x)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def is_empty(self):\n        return len(self.items) == 0\n",
    "def read_config(path):\n    with open(path) as f:\n        lines = f.readlines()\n"
    "    config = {}\n    for line in lines:\n        key, value = line.strip().split('=')\n"
    "        config[key] = value\n    return config\n",
    "def fibonacci(n):\n    a, b = 0, 1\n    result = []\n    for _ in range(n):\n"
    "        result.append(a)\n        a, b = b, a + b\n    return result\n",
]
_EDITS = [
    "Rename the first function's arguments to be more descriptive",
    "Add type hints to every function",
    "Add a short comment above each line that changes state",
    "Replace the loop with a comprehension where possible",
]
_FOLLOW_UP = "Good. Now print the complete final code once more, unchanged, in one block."
_CHAT = [
    "Write a short poem about the sea at night.",
    "Tell me a two-sentence story about a lost robot.",
    "Describe a sunrise in the mountains in a few sentences.",
    "Invent a name and a motto for a bakery run by cats.",
]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated")
    parser.add_argument("--output-len", type=int, default=160)
    parser.add_argument(
        "--passes", type=int, default=1,
        help="run the methods this many times, in alternating order, each on a fresh engine "
        "(a shared machine's noise shows as the spread between passes)",
    )  # fmt: skip
    parser.add_argument("--output-json", default=None, help="write the results as JSON here")


def _chat_ids(tokenizer: Any, turns: list[str]) -> list[int]:
    roles = ["user", "assistant"]
    messages = [{"role": roles[i % 2], "content": text} for i, text in enumerate(turns)]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def _spec_counters(llm: Any) -> dict[str, float]:
    from kvserve.metrics.reader import Counter

    return {
        m.name.removeprefix("kvserve:spec_decode_"): float(m.value)
        for m in llm.get_metrics()
        if m.name.startswith("kvserve:spec_decode") and isinstance(m, Counter)
    }


def _run_workload(llm: Any, name: str, output_len: int) -> tuple[dict[str, Any], list[Any]]:
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=output_len)
    first = [f"{edit}:\n\n```python\n{code}```" for code, edit in zip(_CODE, _EDITS, strict=True)]
    if name == "chat":
        rounds: list[list[list[int]]] = [[_chat_ids(tokenizer, [p]) for p in _CHAT]]
    else:
        rounds = [[_chat_ids(tokenizer, [p]) for p in first]]
    before = _spec_counters(llm)
    tokens: list[Any] = []
    output_tokens, elapsed = 0, 0.0
    for index in range(1 if name == "chat" else 3):
        if index == 1:  # one turn later: the first answers in the history
            answers = [tokenizer.decode(t) for t in tokens[0]]
            rounds.append(
                [
                    _chat_ids(tokenizer, [p, a, _FOLLOW_UP])
                    for p, a in zip(first, answers, strict=True)
                ]
            )
        elif index == 2:  # the first round again
            rounds.append(rounds[0])
        prompts = [{"prompt_token_ids": p} for p in rounds[index]]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed += time.perf_counter() - start
        got = [list(o.outputs[0].token_ids) for o in outputs]
        tokens.append(got)
        output_tokens += sum(len(t) for t in got)
    after = _spec_counters(llm)
    drafts = after.get("num_drafts", 0) - before.get("num_drafts", 0)
    drafted = after.get("num_draft_tokens", 0) - before.get("num_draft_tokens", 0)
    accepted = after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
    return {
        "output_tokens": output_tokens,
        "elapsed_s": round(elapsed, 3),
        "output_tok_per_s": round(output_tokens / elapsed, 2),
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        # vLLM's mean acceptance length: the tokens a verifying step emits on average.
        "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else None,
        "draft_tokens": int(drafted),
        # Target forwards per request summed (each emits 1 + its accepted drafts): the
        # machine-independent cost, where tok/s on a shared machine is noisy.
        "request_steps": output_tokens - int(accepted),
    }, tokens


def run_spec_decode(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve.entrypoints.llm import LLM

    results: dict[str, Any] = {}
    reference: dict[str, Any] = {}
    methods = args.methods.split(",")
    for unknown in set(methods) - set(METHODS):
        raise ValueError(f"--methods: unknown method {unknown!r} (known: {', '.join(METHODS)})")
    order = [(i, m) for i in range(args.passes) for m in (methods if i % 2 == 0 else methods[::-1])]
    for pass_index, method in order:
        engine_args = EngineArgs.from_cli_args(args)
        kwargs = dataclasses.asdict(engine_args)
        kwargs["disable_log_stats"] = False
        if METHODS[method] is not None:
            kwargs["speculative_config"] = json.dumps(METHODS[method])
        llm = LLM(**kwargs)
        try:
            # A warm-up outside the measurement (compilation, allocator).
            llm.generate("Hello", SamplingParams(max_tokens=8), use_tqdm=False)
            for workload in ("agentic", "chat"):
                result, tokens = _run_workload(llm, workload, args.output_len)
                reference.setdefault(workload, tokens)
                result["same_tokens_as_first_method"] = tokens == reference[workload]
                results[f"{workload}/{method}/pass{pass_index}"] = result
                print(f"{workload:8s} {method:7s} {pass_index} {json.dumps(result)}", flush=True)
        finally:
            llm.llm_engine.shutdown()
    return results


def main(args: argparse.Namespace) -> int:
    results = run_spec_decode(args)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
