"""Helpers for the KV connector tests: configs, prompts, driving a real EngineCore by hand."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from kvserve.protocol.engine_core import EngineCoreOutput
from kvserve.sampling_params import SamplingParams

TEST_CONNECTORS = "tests.distributed.kv_transfer.connectors_for_tests"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def shared_storage(path: Path | str, **fields: Any) -> dict[str, Any]:
    return {
        "kv_connector": "SharedStorageConnector",
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
        **fields,
    }


def async_loading(path: Path | str) -> dict[str, Any]:
    return {
        "kv_connector": "AsyncLoadingConnector",
        "kv_connector_module_path": TEST_CONNECTORS,
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


def multi(*children: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {
        "kv_connector": "MultiConnector",
        "kv_connector_extra_config": {"connectors": list(children)},
        **fields,
    }


def as_json(config: dict[str, Any]) -> str:
    # llm_factory caches engines by their kwargs, which must be hashable: pass JSON text.
    return json.dumps(config, sort_keys=True)


def prompt_ids(tokenizer: Any, topic: str) -> list[int]:
    """A prompt of ~50 tokens (3 full blocks of 16 and a tail), distinct per topic."""
    text = (
        f"Here is a short story about {topic}. Once upon a time, in a quiet village by the "
        f"sea, there lived a curious child who loved {topic} more than anything else, and "
        "every morning the child would walk along the shore, looking for shells and "
        "stones, and telling stories to the gulls"
    )
    ids = list(tokenizer.encode(text))
    assert len(ids) >= 53, len(ids)
    return ids[:53]


def with_params(params: dict[str, Any]) -> SamplingParams:
    return GREEDY.clone(extra_args={"kv_transfer_params": params})


def entries(root: Path) -> set[str]:
    """Published entries (hidden temp dirs excluded)."""
    return {p.name for p in root.iterdir() if not p.name.startswith(".")}


def core_of(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core


def drain(llm: Any, timeout: float = 10.0) -> None:
    """Steps the in-process core until nothing is pending (e.g. delayed block frees)."""
    core = core_of(llm)
    deadline = time.monotonic() + timeout
    while core.scheduler.has_requests():
        if time.monotonic() > deadline:
            raise AssertionError("the engine core still holds work after the timeout")
        core.step()
        time.sleep(0.01)


def run_by_hand(
    llm: Any,
    request_id: str,
    ids: list[int],
    params: SamplingParams = GREEDY,
    timeout: float = 30.0,
) -> tuple[list[int], list[int], EngineCoreOutput]:
    """Runs one request through the real core step by step: (tokens scheduled for it per
    step, its output tokens, its final output). Steps that schedule nothing (KV still on
    its way from another engine) pause briefly: a step budget rather than a clock would
    let a fast machine give up before a transfer could arrive."""
    core = core_of(llm)
    request, _ = llm.llm_engine.input_processor.process_inputs(
        request_id, {"prompt_token_ids": ids}, params
    )
    core.add_request(request)
    scheduled: list[int] = []
    tokens: list[int] = []
    final: EngineCoreOutput | None = None
    deadline = time.monotonic() + timeout
    while core.scheduler.has_requests() and time.monotonic() < deadline:
        scheduler_output = core.scheduler.schedule()
        core.model_executor.execute_model(scheduler_output)
        runner_output = core.model_executor.sample_tokens()
        outputs = core.scheduler.update_from_output(scheduler_output, runner_output)
        scheduled.append(scheduler_output.num_scheduled_tokens.get(request_id, 0))
        for output in outputs.outputs:
            tokens.extend(output.new_token_ids)
            if output.finished:
                final = output
        if not scheduler_output.total_num_scheduled_tokens:
            time.sleep(0.01)
    assert final is not None, "the request did not finish"
    return scheduled, tokens, final
