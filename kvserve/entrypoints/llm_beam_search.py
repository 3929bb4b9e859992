"""LLM.beam_search: drives kvserve.beam_search with the offline engine, a step at a time."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from kvserve.beam_search import BeamSearch, BeamSearchInstance, BeamSearchOutput
from kvserve.inputs import PromptType
from kvserve.sampling_params import BeamSearchParams

if TYPE_CHECKING:
    from kvserve.entrypoints.llm import LLM


def prompt_token_ids(tokenizer: Any, prompt: PromptType) -> list[int]:
    """A prompt's ids: a string or {"prompt": ...} is tokenized as generate() does."""
    fields: Mapping[str, Any] = prompt if isinstance(prompt, Mapping) else {"prompt": prompt}
    if fields.get("prompt_token_ids") is not None:
        return list(fields["prompt_token_ids"])
    text = fields.get("prompt")
    if not isinstance(text, str) or not text:
        raise ValueError(
            "beam_search prompts must be non-empty strings, {'prompt': str} or "
            f"{{'prompt_token_ids': [...]}}, got {prompt!r}"
        )
    return list(tokenizer.encode(text, add_special_tokens=True))


def run_beam_search(
    llm: LLM,
    prompts: Sequence[PromptType],
    params: BeamSearchParams,
    use_tqdm: bool,
    concurrency_limit: int | None,
) -> list[BeamSearchOutput]:
    """The best beams of every prompt, searching ``concurrency_limit`` prompts at a time.

    Every step is one generate() over all live beams: a beam's sequence is its request's
    prompt, so the prefix cache serves what beams share and only new blocks are computed.
    """
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
    if isinstance(prompts, str | Mapping):
        prompts = [prompts]
    if concurrency_limit is not None and concurrency_limit < 1:
        raise ValueError(f"concurrency_limit must be at least 1, got {concurrency_limit}")
    tokenizer = llm.get_tokenizer()
    processor = llm.llm_engine.input_processor
    eos = [processor.eos_token_id] if processor.eos_token_id is not None else []
    search = BeamSearch(
        params,
        [*eos, *processor.extra_eos_token_ids],
        processor.max_model_len,
        processor.max_logprobs,
    )
    sampling_params = search.sampling_params()
    all_ids = [prompt_token_ids(tokenizer, p) for p in prompts]
    limit = concurrency_limit or max(len(all_ids), 1)
    outputs: list[BeamSearchOutput] = []
    bar = tqdm(total=len(all_ids), desc="Beam search", disable=not use_tqdm)
    for start in range(0, len(all_ids), limit):
        instances = [BeamSearchInstance.start(ids) for ids in all_ids[start : start + limit]]
        for _ in range(params.max_tokens):
            beams = search.live_beams(instances)
            if not beams:
                break
            results = llm.generate(
                [{"prompt_token_ids": beam.tokens} for beam in beams],
                sampling_params,
                use_tqdm=False,
            )
            search.advance(instances, [r.outputs[0].logprobs[0] for r in results])  # type: ignore[index]
        for instance in instances:
            outputs.append(search.finish(instance, tokenizer.decode))
            bar.update(1)
    bar.close()
    return outputs
