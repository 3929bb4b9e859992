from __future__ import annotations

import msgspec
import pytest
from transformers import PreTrainedTokenizerBase

from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.parallel_sampling import ParentRequest
from kvserve.outputs import RequestOutput
from kvserve.protocol.engine_core import EngineCoreOutput, EngineCoreRequest, FinishReason
from kvserve.sampling_params import RequestOutputKind, SamplingParams
from kvserve.transformers_utils import get_tokenizer, resolve_model


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    return get_tokenizer(resolve_model(None))


def test_child_ids_and_params() -> None:
    parent = ParentRequest("p", SamplingParams(n=3, seed=10, temperature=0.8))
    children = [parent.get_child_info(i) for i in range(3)]
    assert [cid for cid, _ in children] == ["0_p", "1_p", "2_p"]
    assert [sp.seed for _, sp in children] == [10, 11, 12]
    assert all(sp.n == 1 and sp.temperature == 0.8 for _, sp in children)
    assert parent.child_requests == {"0_p", "1_p", "2_p"}
    unseeded = ParentRequest("q", SamplingParams(n=2))
    (_, a), (_, b) = unseeded.get_child_info(0), unseeded.get_child_info(1)
    assert a.seed is None and a.n == 1 and a == b
    with pytest.raises(ValueError, match="child index"):
        unseeded.get_child_info(2)


def add_parent(
    proc: OutputProcessor, tok: PreTrainedTokenizerBase, kind: RequestOutputKind
) -> ParentRequest:
    params = SamplingParams(n=2, max_tokens=8, output_kind=kind)
    request = EngineCoreRequest(
        request_id="p",
        prompt_token_ids=tok.encode("Name a colour:"),
        sampling_params=params,
        eos_token_id=2,
        arrival_time=0.0,
    )
    parent = ParentRequest("p", params)
    for index in range(2):
        child_id, child_params = parent.get_child_info(index)
        child = msgspec.structs.replace(request, request_id=child_id, sampling_params=child_params)
        proc.add_request(child, "Name a colour:", parent, index)
    return parent


def step(
    proc: OutputProcessor, child: str, token_id: int, finish: FinishReason | None = None
) -> list[RequestOutput]:
    eco = EngineCoreOutput(request_id=child, new_token_ids=[token_id], finish_reason=finish)
    return proc.process_outputs([eco]).request_outputs


def test_final_only_waits_for_all_children(tok: PreTrainedTokenizerBase) -> None:
    proc = OutputProcessor(tok)
    add_parent(proc, tok, RequestOutputKind.FINAL_ONLY)
    red, blue = tok.encode(" red")[0], tok.encode(" blue")[0]
    assert step(proc, "1_p", blue) == []
    assert step(proc, "1_p", 2, FinishReason.STOP) == []  # child 1 done, child 0 still running
    assert proc.unfinished_request_ids() == ["p"]
    assert step(proc, "0_p", red) == []
    (out,) = step(proc, "0_p", red, FinishReason.LENGTH)
    assert out.request_id == "p" and out.finished and out.prompt == "Name a colour:"
    assert [c.index for c in out.outputs] == [0, 1]
    assert [c.text for c in out.outputs] == [" red red", " blue"]
    assert [c.finish_reason for c in out.outputs] == ["length", "stop"]
    assert "text=' blue'" in repr(out) and "request_id='p'" in repr(out)
    assert not proc.has_unfinished_requests() and proc.parent_requests == {}


def test_cumulative_forwards_each_child_with_its_index(tok: PreTrainedTokenizerBase) -> None:
    proc = OutputProcessor(tok)
    add_parent(proc, tok, RequestOutputKind.CUMULATIVE)
    red, blue = tok.encode(" red")[0], tok.encode(" blue")[0]
    (a,) = step(proc, "0_p", red)
    (b,) = step(proc, "1_p", blue, FinishReason.LENGTH)
    (c,) = step(proc, "0_p", red, FinishReason.LENGTH)
    assert [(o.request_id, o.outputs[0].index, o.outputs[0].text) for o in (a, b, c)] == [
        ("p", 0, " red"),
        ("p", 1, " blue"),
        ("p", 0, " red red"),
    ]
    # The parent is finished only when its last child is.
    assert [a.finished, b.finished, c.finished] == [False, False, True]


def test_abort_parent_aborts_children(tok: PreTrainedTokenizerBase) -> None:
    proc = OutputProcessor(tok)
    add_parent(proc, tok, RequestOutputKind.DELTA)
    assert sorted(proc.abort_requests(["p"])) == ["0_p", "1_p"]
    assert not proc.has_unfinished_requests() and proc.parent_requests == {}
