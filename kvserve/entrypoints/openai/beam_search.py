"""`use_beam_search` on /v1/completions: kvserve.beam_search driven by the async engine.

Every step submits each live beam as its own request (the prefix cache serves what the
beams share) and waits for all of them; the result is one RequestOutput whose samples
are the best beams, so the completion endpoint formats it like any other.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from kvserve.beam_search import BeamSearch, BeamSearchInstance
from kvserve.engine.engine_client import EngineClient
from kvserve.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.sampling_params import BeamSearchParams


def eos_token_ids(engine_client: EngineClient) -> list[int]:
    """The model's end-of-sequence ids (the tokenizer's when the config names none)."""
    ids = list(engine_client.model_config.arch.eos_token_ids)
    eos = getattr(engine_client.tokenizer, "eos_token_id", None)
    return ids or ([eos] if eos is not None else [])


async def beam_search(
    engine_client: EngineClient,
    prompt_ids: list[int],
    params: BeamSearchParams,
    request_id: str,
    max_model_len: int,
    priority: int = 0,
    cache_salt: str | None = None,
) -> AsyncGenerator[RequestOutput, None]:
    """Yields one finished RequestOutput: the ``beam_width`` best beams, best first.

    Cancelling it cancels the step's requests, which aborts them in the engine.
    """
    search = BeamSearch(
        params,
        eos_token_ids(engine_client),
        max_model_len,
        engine_client.model_config.max_logprobs,
    )
    sampling_params = search.sampling_params()
    instance = BeamSearchInstance.start(prompt_ids)

    async def candidates(tokens: list[int], beam_id: str) -> dict[int, Logprob]:
        final: RequestOutput | None = None
        async for output in engine_client.generate(
            {"prompt_token_ids": tokens},
            sampling_params,
            beam_id,
            priority=priority,
            cache_salt=cache_salt,
        ):
            final = output
        assert final is not None and final.outputs[0].logprobs
        return final.outputs[0].logprobs[0]

    for step in range(params.max_tokens):
        beams = search.live_beams([instance])
        if not beams:
            break
        tasks = [
            asyncio.ensure_future(candidates(b.tokens, f"{request_id}-beam{step}-{i}"))
            for i, b in enumerate(beams)
        ]
        try:
            rows = await asyncio.gather(*tasks)
        except BaseException:
            # One beam failed or the client left: abort the step's other requests too.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        search.advance([instance], rows)
    result = search.finish(instance, engine_client.tokenizer.decode)
    yield RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=prompt_ids,
        prompt_logprobs=None,
        outputs=[
            CompletionOutput(
                index=i,
                text=beam.text or "",
                token_ids=beam.tokens[len(prompt_ids) :],
                cumulative_logprob=beam.cum_logprob,
                finish_reason=beam.finish_reason,
                stop_reason=beam.stop_reason,
            )
            for i, beam in enumerate(result.sequences)
        ],
        finished=True,
    )
