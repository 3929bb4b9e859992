"""HF transformers as the correctness reference, on the same GGUF weights, plus shared checks."""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvserve.benchmarks.peers_hf import one_gguf_parse
from kvserve.benchmarks.quant_accuracy import teacher_forced_agreement
from kvserve.transformers_utils.model_resolver import resolve_model


class HFReference:
    """Greedy decoding and log-softmax from transformers' own GGUF loader, in float32."""

    def __init__(self) -> None:
        from pathlib import Path

        from transformers import AutoModelForCausalLM, AutoTokenizer

        resolved = resolve_model(None)
        gguf = Path(resolved.path)
        with one_gguf_parse():
            self.tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            self.model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            ).eval()
        self._greedy_cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """Exactly max_tokens argmax tokens (EOS does not stop it, like ignore_eos=True)."""
        key = (tuple(prompt_ids), max_tokens)
        if key not in self._greedy_cache:
            # logits_to_keep=1: the prompt's other rows would be a vocab-wide matmul each.
            out = self.model(torch.tensor([prompt_ids]), use_cache=True, logits_to_keep=1)
            past, tokens = out.past_key_values, []
            next_id = int(out.logits[0, -1].argmax())
            for _ in range(max_tokens - 1):
                tokens.append(next_id)
                out = self.model(torch.tensor([[next_id]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                next_id = int(out.logits[0, -1].argmax())
            tokens.append(next_id)
            self._greedy_cache[key] = tokens
        return self._greedy_cache[key]

    @torch.inference_mode()
    def log_softmax(self, token_ids: list[int]) -> torch.Tensor:
        """[len(token_ids), vocab]: row i is the distribution of the token after position i."""
        logits = self.model(torch.tensor([token_ids])).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)


@functools.lru_cache(maxsize=1)
def hf_reference() -> HFReference:
    return HFReference()


def assert_no_leak(llm: Any) -> None:
    """Every KV block is back in the free queue and the pool's invariants hold."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    core = engine.engine_core.engine_core
    scheduler = core.scheduler
    assert scheduler.get_num_unfinished_requests() == 0
    pool = scheduler.kv_cache_manager.block_pool
    pool.check_integrity()
    assert pool.get_num_free_blocks() == core.kv_cache_config.num_blocks - 1


def assert_near_greedy(
    engine: Any, prompts: list[list[int]], expected: list[list[int]], got: list[list[int]]
) -> None:
    """For lossy paths. Free-running, one flip at a near tie changes the rest of a
    continuation, so: every token ``got`` holds is within 0.5 nats of HF's own choice at
    that step, and fed HF's continuation, the engine's top choice is HF's at > 90% of
    steps."""
    reference = hf_reference()
    for prompt, continuation, want in zip(prompts, got, expected, strict=True):
        logprobs = reference.log_softmax(prompt + continuation)[len(prompt) - 1 : -1]
        chosen = logprobs.gather(1, torch.tensor(continuation)[:, None])[:, 0]
        gap = (logprobs.max(dim=1).values - chosen).max().item()
        assert gap < 0.5, (gap, continuation, want)
    assert teacher_forced_agreement(engine, prompts, expected) > 0.9
