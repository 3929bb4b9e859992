from __future__ import annotations

import asyncio
import math
import time

import pytest
from transformers import PreTrainedTokenizerBase

from kvserve.engine.output_processor import OutputProcessor, RequestOutputCollector
from kvserve.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.protocol.engine_core import EngineCoreOutput, EngineCoreRequest, FinishReason
from kvserve.sampling_params import RequestOutputKind, SamplingParams
from kvserve.transformers_utils import get_tokenizer, resolve_model

EOS = 2
TEXT = "Paged attention keeps the KV cache in blocks — naïve café ☕."


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    return get_tokenizer(resolve_model(None))


def make_request(
    tok: PreTrainedTokenizerBase, request_id: str = "r", arrival: float = 100.0, **params: object
) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=tok.encode("Tell me about vLLM."),
        sampling_params=SamplingParams(**params),  # type: ignore[arg-type]
        eos_token_id=EOS,
        arrival_time=arrival,
    )


def run(
    proc: OutputProcessor, request_id: str, ids: list[int], finish: FinishReason | None
) -> list[RequestOutput]:
    """Feeds ids one per step; the last step carries ``finish``."""
    outs: list[RequestOutput] = []
    for i, token_id in enumerate(ids):
        last = i == len(ids) - 1
        eco = EngineCoreOutput(
            request_id=request_id, new_token_ids=[token_id], finish_reason=finish if last else None
        )
        outs += proc.process_outputs([eco], engine_core_timestamp=200.0 + i).request_outputs
    return outs


def test_cumulative_outputs_grow_and_eos_is_hidden(tok: PreTrainedTokenizerBase) -> None:
    proc = OutputProcessor(tok)
    ids = [*tok.encode(TEXT), EOS]
    proc.add_request(make_request(tok), "Tell me about vLLM.")
    outs = run(proc, "r", ids, FinishReason.STOP)
    assert len(outs) == len(ids)
    for n, out in enumerate(outs, start=1):
        assert out.outputs[0].token_ids == ids[:n]
        assert TEXT.startswith(out.outputs[0].text)
    final = outs[-1]
    assert final.finished and final.prompt == "Tell me about vLLM."
    assert final.prompt_token_ids == tok.encode("Tell me about vLLM.")
    assert final.outputs[0].text == TEXT
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason is None
    assert not any(o.finished for o in outs[:-1])
    assert not proc.has_unfinished_requests()
    assert proc.get_num_unfinished_requests() == 0


def test_delta_outputs_concatenate_to_the_full_text(tok: PreTrainedTokenizerBase) -> None:
    proc = OutputProcessor(tok)
    ids = tok.encode(TEXT)
    proc.add_request(make_request(tok, output_kind=RequestOutputKind.DELTA), None)
    outs = run(proc, "r", ids, FinishReason.LENGTH)
    assert [o.outputs[0].token_ids for o in outs] == [[i] for i in ids]
    assert "".join(o.outputs[0].text for o in outs) == TEXT
    assert outs[-1].outputs[0].finish_reason == "length"


def test_final_only_gives_one_output(tok: PreTrainedTokenizerBase) -> None:
    proc = OutputProcessor(tok)
    ids = tok.encode(TEXT)
    proc.add_request(make_request(tok, output_kind=RequestOutputKind.FINAL_ONLY), None)
    outs = run(proc, "r", ids, FinishReason.LENGTH)
    assert len(outs) == 1
    assert outs[0].finished and outs[0].outputs[0].text == TEXT
    assert outs[0].outputs[0].token_ids == ids


def test_stop_string_finishes_and_asks_core_to_abort(tok: PreTrainedTokenizerBase) -> None:
    proc = OutputProcessor(tok)
    proc.add_request(make_request(tok, stop=["KV"]), None)
    ids = tok.encode(TEXT)
    outs: list[RequestOutput] = []
    aborted: list[str] = []
    for token_id in ids:
        result = proc.process_outputs([EngineCoreOutput(request_id="r", new_token_ids=[token_id])])
        outs += result.request_outputs
        aborted += result.reqs_to_abort
        if outs[-1].finished:
            break
    final = outs[-1].outputs[0]
    assert aborted == ["r"]
    assert final.text == "Paged attention keeps the "
    assert final.finish_reason == "stop" and final.stop_reason == "KV"
    assert not proc.has_unfinished_requests()
    # Outputs the core produced before it saw the abort are dropped.
    late = proc.process_outputs([EngineCoreOutput(request_id="r", new_token_ids=[5])])
    assert late.request_outputs == []


def test_error_output_is_a_finished_error(tok: PreTrainedTokenizerBase) -> None:
    proc = OutputProcessor(tok)
    proc.add_request(make_request(tok), None)
    eco = EngineCoreOutput(
        request_id="r", new_token_ids=[], finish_reason=FinishReason.ERROR, error="OOM in step"
    )
    (out,) = proc.process_outputs([eco]).request_outputs
    assert out.finished and out.outputs[0].finish_reason == "error"
    assert out.error == "OOM in step" and out.outputs[0].error == "OOM in step"


def test_abort_forgets_the_request(tok: PreTrainedTokenizerBase) -> None:
    proc = OutputProcessor(tok)
    proc.add_request(make_request(tok, request_id="a"), None)
    proc.add_request(make_request(tok, request_id="b"), None)
    assert proc.unfinished_request_ids() == ["a", "b"]
    assert proc.abort_requests(["a", "missing"]) == ["a"]
    assert proc.unfinished_request_ids() == ["b"]
    with pytest.raises(ValueError, match="already running"):
        proc.add_request(make_request(tok, request_id="b"), None)


def test_logprobs_rows_become_dicts(tok: PreTrainedTokenizerBase) -> None:
    proc = OutputProcessor(tok)
    proc.add_request(
        make_request(tok, logprobs=2, prompt_logprobs=1, output_kind=RequestOutputKind.DELTA),
        None,
    )
    hello, world, comma = tok.encode("Hello")[0], tok.encode(" world")[0], tok.encode(",")[0]
    eco = EngineCoreOutput(
        request_id="r",
        new_token_ids=[world],
        new_logprobs_token_ids=[[world, comma, world]],
        new_logprobs=[[-0.5, -0.2, -0.5]],
        new_sampled_token_ranks=[2],
        new_prompt_logprobs_token_ids=[[hello, comma], [world, world]],
        new_prompt_logprobs=[[-3.0, -1.0], [-0.1, -0.1]],
        new_prompt_logprobs_ranks=[4, 1],
    )
    (out,) = proc.process_outputs([eco]).request_outputs
    (position,) = out.outputs[0].logprobs or []
    # Sampled token first (rank 2); the top-2 follow (the sampled one among them).
    assert list(position) == [world, comma]
    assert position[comma] == Logprob(-0.2, 1, ",")
    assert position[world] == Logprob(-0.5, 2, " world")
    assert out.outputs[0].cumulative_logprob == pytest.approx(-0.5)
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert out.prompt_logprobs[1] == {
        hello: Logprob(-3.0, 4, "Hello"),
        comma: Logprob(-1.0, 1, ","),
    }
    assert out.prompt_logprobs[2] == {world: Logprob(-0.1, 1, " world")}

    eco2 = EngineCoreOutput(
        request_id="r",
        new_token_ids=[comma],
        new_logprobs_token_ids=[[comma, comma, world]],
        new_logprobs=[[-0.25, -0.25, -1.5]],
        new_sampled_token_ranks=[1],
        finish_reason=FinishReason.LENGTH,
    )
    (out2,) = proc.process_outputs([eco2]).request_outputs
    # DELTA: only the new position and no prompt logprobs again.
    assert [list(p) for p in out2.outputs[0].logprobs or []] == [[comma, world]]
    assert out2.prompt_logprobs == []
    assert math.isclose(out2.outputs[0].cumulative_logprob or 0.0, -0.75)


def test_no_logprobs_requested_gives_none(tok: PreTrainedTokenizerBase) -> None:
    proc = OutputProcessor(tok)
    proc.add_request(make_request(tok), None)
    (out,) = run(proc, "r", [5], FinishReason.LENGTH)
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None
    assert out.prompt_logprobs is None


def test_metrics_timestamps(tok: PreTrainedTokenizerBase) -> None:
    proc = OutputProcessor(tok, log_stats=True)
    arrival = time.time()
    proc.add_request(make_request(tok, arrival=arrival), None)
    outs = run(proc, "r", tok.encode("one two three"), FinishReason.LENGTH)
    first, last = outs[0].metrics, outs[-1].metrics
    assert first is not None and last is not None
    assert first.finished_time is None and first.num_generation_tokens == 1
    assert last.arrival_time == arrival
    assert last.first_token_time == first.first_token_time == first.last_token_time
    assert arrival <= last.first_token_time <= last.last_token_time <= time.time()
    assert last.finished_time == last.last_token_time
    assert 0.0 <= (last.time_to_first_token or -1.0) < 60.0
    assert last.num_generation_tokens == len(outs)


def _output(text: str, ids: list[int], finished: bool = False, index: int = 0) -> RequestOutput:
    completion = CompletionOutput(
        index=index, text=text, token_ids=ids, finish_reason="length" if finished else None
    )
    return RequestOutput("r", None, [1], None, [completion], finished)


def test_collector_merges_deltas_for_a_slow_consumer() -> None:
    collector = RequestOutputCollector(RequestOutputKind.DELTA)
    assert collector.get_nowait() is None
    collector.put(_output("Hel", [1]))
    collector.put(_output("Bye", [7], index=1))  # another sample of the same request (n=2)
    collector.put(_output("lo", [2], finished=True))
    merged = collector.get_nowait()
    assert merged is not None and merged.finished
    assert merged.outputs[0].text == "Hello" and merged.outputs[0].token_ids == [1, 2]
    assert merged.outputs[1].index == 1 and merged.outputs[1].text == "Bye"
    assert merged.outputs[0].finish_reason == "length"
    assert collector.get_nowait() is None


def test_collector_replaces_cumulative_and_wakes_async_consumer() -> None:
    async def main() -> tuple[RequestOutput, RequestOutput]:
        collector = RequestOutputCollector(RequestOutputKind.CUMULATIVE)
        waiter = asyncio.create_task(collector.get())
        await asyncio.sleep(0)
        collector.put(_output("He", [1]))
        first = await waiter
        collector.put(_output("Hel", [1, 2]))
        collector.put(_output("Hello", [1, 2, 3]))
        return first, await collector.get()

    first, second = asyncio.run(main())
    assert first.outputs[0].text == "He"
    assert second.outputs[0].text == "Hello" and second.outputs[0].token_ids == [1, 2, 3]


def test_queue_receives_outputs_and_errors(tok: PreTrainedTokenizerBase) -> None:
    proc = OutputProcessor(tok)
    queue = RequestOutputCollector(RequestOutputKind.DELTA)
    proc.add_request(make_request(tok, output_kind=RequestOutputKind.DELTA), None, queue=queue)
    ids = tok.encode("Hi there")
    result = proc.process_outputs(
        [EngineCoreOutput(request_id="r", new_token_ids=[i]) for i in ids]
    )
    assert result.request_outputs == []
    got = queue.get_nowait()
    assert got is not None and got.outputs[0].text == "Hi there"
    proc.propagate_error(RuntimeError("engine died"))
    with pytest.raises(RuntimeError, match="engine died"):
        queue.get_nowait()
