"""Helpers of the scheduler: stop checks and building its outputs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.core.request import Request, RequestStatus
from kvserve.protocol.engine_core import EngineCoreOutput
from kvserve.protocol.scheduler_output import CachedRequestData

if TYPE_CHECKING:
    from kvserve.core.kv_cache_manager import KVCacheBlocks
    from kvserve.protocol.runner_output import ModelRunnerOutput


def check_stop(request: Request, max_model_len: int) -> bool:
    """Whether the request is done after its latest token; sets its status if so.

    Order matters: the length caps win over min_tokens, and min_tokens over eos and
    stop tokens. Stop strings are the front end's job (they need detokenized text).
    """
    if request.num_tokens >= max_model_len or (
        request.max_tokens is not None and request.num_output_tokens >= request.max_tokens
    ):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    params = request.sampling_params
    if request.num_output_tokens < params.min_tokens:
        return False
    last_token_id = request.output_token_ids[-1]
    if not params.ignore_eos and last_token_id == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last_token_id in (params.stop_token_ids or ()):
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last_token_id
        return True
    return False


def make_cached_request_data(
    running: list[Request],
    resumed: list[Request],
    req_to_new_blocks: dict[str, KVCacheBlocks],
    num_scheduled_tokens: dict[str, int] | None = None,
) -> CachedRequestData:
    """Diffs for requests the workers hold: appended blocks, or the whole table on resume.

    ``num_scheduled_tokens`` (pipeline parallelism): also send the tokens each request
    computes in this step, sampled ones included, which only the last stage has seen.
    """
    data = CachedRequestData()
    flags = [False] * len(running) + [True] * len(resumed)
    for request, is_resumed in zip([*running, *resumed], flags, strict=True):
        new_blocks = req_to_new_blocks[request.request_id]
        data.req_ids.append(request.request_id)
        data.resumed_from_preemption.append(is_resumed)
        data.new_block_ids.append(None if new_blocks.is_empty() else new_blocks.get_block_ids())
        data.num_computed_tokens.append(request.num_computed_tokens)
        # Placeholders included: the worker has appended the tokens of steps in flight.
        data.num_output_tokens.append(request.num_output_tokens + request.num_output_placeholders)
        if num_scheduled_tokens is not None:
            start = request.num_computed_tokens  # not yet advanced by this step
            end = start + num_scheduled_tokens[request.request_id]
            data.new_token_ids.append(request.all_token_ids[start:end])
    return data


def make_engine_core_output(
    request: Request,
    new_token_ids: list[int],
    model_runner_output: ModelRunnerOutput,
    req_index: int | None,
) -> EngineCoreOutput | None:
    """One request's output of a step; None when there is nothing to report."""
    prompt_logprobs = model_runner_output.prompt_logprobs_dict.get(request.request_id)
    finish_reason = request.get_finished_reason()
    if not new_token_ids and prompt_logprobs is None and finish_reason is None:
        return None  # a partial prefill chunk
    output = EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=new_token_ids,
        finish_reason=finish_reason,
        stop_reason=request.stop_reason,
        num_cached_tokens=max(request.num_cached_tokens, 0),
    )
    logprobs = model_runner_output.logprobs
    if (
        logprobs is not None
        and new_token_ids
        and req_index is not None
        and request.sampling_params.logprobs is not None
    ):
        starts = model_runner_output.logprobs_row_starts
        start = req_index if starts is None else starts[req_index]
        rows = logprobs.slice(start, start + len(new_token_ids))
        output.new_logprobs_token_ids = rows.logprob_token_ids
        output.new_logprobs = rows.logprobs
        output.new_sampled_token_ranks = rows.sampled_token_ranks
    if prompt_logprobs is not None:
        lists = prompt_logprobs.tolists()
        output.new_prompt_logprobs_token_ids = lists.logprob_token_ids
        output.new_prompt_logprobs = lists.logprobs
        output.new_prompt_logprobs_ranks = lists.sampled_token_ranks
    return output


def too_long_message(
    request: Request, max_model_len: int, pool_blocks: int, block_size: int
) -> str:
    """Why a request can never run: its prompt or its whole length does not fit."""
    if request.num_prompt_tokens > max_model_len:
        return (
            f"the prompt ({request.num_prompt_tokens} tokens) is longer than "
            f"max_model_len ({max_model_len})"
        )
    return (
        f"the request needs {request.num_tokens} tokens of KV cache, more than the "
        f"{pool_blocks} blocks of {block_size} tokens the pool holds"
    )
