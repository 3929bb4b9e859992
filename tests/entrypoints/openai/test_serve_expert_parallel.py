"""`kvserve serve -dp 2 --enable-expert-parallel` on a tiny random Qwen3-MoE (token-id
prompts, no tokenizer): a concurrent batch and a lone request (one core idle) are served
with HF's greedy tokens, checked through the sampled tokens' logprobs (the server returns
no text without a tokenizer), and SIGTERM stops the server and both cores cleanly."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import openai
import torch

from tests.entrypoints.openai.utils import RemoteServer
from tests.family_models import build_family_model, hf_greedy, hf_log_softmax

MAX_TOKENS = 5
PROMPTS = [[5, 9, 23, 40, 7], [3, 3, 50, 61, 2, 17, 88], [100, 12], [44, 45, 46, 47]]


def _hf_token_logprobs(model: object, prompt: list[int]) -> list[float]:
    """HF's logprob of each of its greedy tokens, in order."""
    tokens = hf_greedy(model, prompt, MAX_TOKENS)
    rows = hf_log_softmax(model, prompt + tokens)
    return [float(rows[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


async def _served_logprobs(client: openai.AsyncOpenAI, prompt: list[int]) -> list[float]:
    completion = await client.completions.create(
        model=(await client.models.list()).data[0].id,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    return [float(x) for x in logprobs.token_logprobs]


def test_expert_parallel_server_serves_hf_greedy_tokens_and_stops(tmp_path: Path) -> None:
    hf = build_family_model("qwen3_moe", tmp_path)
    expected = [_hf_token_logprobs(hf, p) for p in PROMPTS]
    server = RemoteServer(
        str(tmp_path), "-dp", "2", "--enable-expert-parallel", "--skip-tokenizer-init"
    )
    try:

        async def batch() -> list[list[float]]:
            client = server.async_client()
            return list(await asyncio.gather(*(_served_logprobs(client, p) for p in PROMPTS)))

        for got, want in zip(asyncio.run(batch()), expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        lone = asyncio.run(_served_logprobs(server.async_client(), PROMPTS[0]))
        torch.testing.assert_close(lone, expected[0], atol=1e-4, rtol=0)
    finally:
        started = time.monotonic()
        code = server.stop()
    assert code == 0
    assert time.monotonic() - started < 30
