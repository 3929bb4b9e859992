"""ModelRunner on a tiny random Llama, driven by hand-written SchedulerOutputs and
checked against HF transformers (greedy tokens exactly, prompt logprobs to 1e-4)."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvserve.pooling_params import PoolerConfig
from kvserve.protocol.kv_cache_interface import build_kv_cache_config
from kvserve.protocol.runner_output import ModelRunnerOutput
from kvserve.protocol.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from kvserve.sampling_params import SamplingParams
from kvserve.utils.huge_pages import HUGE_PAGE_BYTES, anon_huge_bytes, live_regions, thp_enabled
from kvserve.worker.model_runner import ModelRunner
from kvserve.worker.output_head import PoolingHead

BLOCK_SIZE = 4


@dataclass
class ReqTrack:
    """The scheduler-side facts a test needs to write the next SchedulerOutput."""

    prompt: list[int]
    params: SamplingParams
    outputs: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    sent: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.outputs)


class HandScheduler:
    """Writes SchedulerOutputs by hand-picked token counts and feeds back the results."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.reqs: dict[str, ReqTrack] = {}
        self.next_block = 1  # block 0 is the null block
        self.finished: set[str] = set()
        self.prompt_logprobs: dict[str, list[torch.Tensor]] = {}

    def _alloc(self, n: int) -> list[int]:
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return ids

    def step(
        self,
        schedule: dict[str, int],
        preempt: set[str] = frozenset(),
        resume: set[str] = frozenset(),
    ) -> ModelRunnerOutput:
        new_reqs, cached = [], CachedRequestData()
        for req_id in resume:
            self.reqs[req_id].num_computed = 0
            self.reqs[req_id].blocks = []
        for req_id, n in schedule.items():
            t = self.reqs[req_id]
            need = -(-(t.num_computed + n) // BLOCK_SIZE) - len(t.blocks)
            new_blocks = self._alloc(max(need, 0))
            t.blocks += new_blocks
            if not t.sent:
                t.sent = True
                new_reqs.append(
                    NewRequestData(req_id, t.prompt, t.params, (list(t.blocks),), t.num_computed)
                )
                continue
            cached.req_ids.append(req_id)
            cached.resumed_from_preemption.append(req_id in resume)
            ids = list(t.blocks) if req_id in resume else new_blocks
            cached.new_block_ids.append((ids,) if ids else None)
            cached.num_computed_tokens.append(t.num_computed)
            cached.num_output_tokens.append(len(t.outputs))
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=dict(schedule),
            total_num_scheduled_tokens=sum(schedule.values()),
            finished_req_ids=set(self.finished),
            preempted_req_ids=set(preempt),
        )
        self.finished.clear()
        self.runner.execute_model(out)
        result = self.runner.sample_tokens()
        assert set(result.req_ids) == set(schedule)
        for req_id, n in schedule.items():
            t = self.reqs[req_id]
            t.num_computed += n
            sampled = result.sampled_token_ids[result.req_id_to_index[req_id]]
            assert len(sampled) == (1 if t.num_computed >= t.num_tokens else 0)
            t.outputs += sampled
            if req_id in result.prompt_logprobs_dict:
                lp = result.prompt_logprobs_dict[req_id]
                assert lp is not None
                self.prompt_logprobs.setdefault(req_id, []).append(lp.logprobs)
        return result

    def decode(self, req_ids: list[str]) -> ModelRunnerOutput:
        return self.step({r: 1 for r in req_ids})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaForCausalLM]:
    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return path, model


DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    ),
]


def _make_runner(path: Path, device: str = "cpu", **model_kwargs: Any) -> ModelRunner:
    # float32 on either device: the reference is HF's float32 (CUDA's default is bfloat16).
    model_kwargs.setdefault("dtype", "float32")
    config = EngineConfig(
        ModelConfig(model=str(path), **model_kwargs),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks_override=64),
        SchedulerConfig(),
    )
    runner = ModelRunner(config, torch.device(device))
    runner.load_model()
    specs = runner.get_kv_cache_spec()
    assert len(specs) == 2
    assert all(s.block_size == BLOCK_SIZE and s.num_kv_heads == 2 for s in specs.values())
    runner.initialize_kv_cache(build_kv_cache_config(specs, 0, num_blocks_override=64))
    return runner


@torch.inference_mode()
def _hf_greedy(model: LlamaForCausalLM, prompt: list[int], n: int) -> list[int]:
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_prefill_decode_finish_preempt_resume(
    tiny: tuple[Path, LlamaForCausalLM], device: str
) -> None:
    path, hf = tiny
    runner = _make_runner(path, device)
    sched = HandScheduler(runner)
    prompt_a = [(7 * i + 3) % 256 for i in range(10)]
    prompt_b = [(11 * i + 5) % 256 for i in range(7)]
    sched.reqs["a"] = ReqTrack(prompt_a, SamplingParams(temperature=0.0, prompt_logprobs=3))
    sched.reqs["b"] = ReqTrack(prompt_b, SamplingParams(temperature=0.0, logprobs=2))

    # Step 1: a's first chunk (no sample), b's whole prompt (samples).
    out = sched.step({"a": 6, "b": 7})
    assert out.sampled_token_ids[out.req_id_to_index["a"]] == []
    assert out.logprobs is not None and len(out.logprobs.logprobs) == 2
    b_row = out.req_id_to_index["b"]
    assert out.logprobs.logprob_token_ids[b_row][0] == sched.reqs["b"].outputs[0]
    # Step 2: a's last chunk samples its first token; b decodes.
    sched.step({"a": 4, "b": 1})
    for _ in range(3):
        sched.decode(["a", "b"])
    # b finishes; the next step tells the runner to drop it.
    sched.finished.add("b")
    sched.decode(["a"])
    assert "b" not in runner.requests and runner.input_batch is not None
    assert runner.input_batch.num_reqs == 1
    # A new request c arrives; a is preempted (out of the batch, state kept).
    prompt_c = [(5 * i + 1) % 256 for i in range(5)]
    sched.reqs["c"] = ReqTrack(prompt_c, SamplingParams(temperature=0.0))
    sched.step({"c": 5}, preempt={"a"})
    assert "a" in runner.requests and "a" not in runner.input_batch.req_id_to_index
    # a resumes into fresh blocks, recomputing everything it knows, then decodes with c.
    a = sched.reqs["a"]
    sched.step({"a": a.num_tokens, "c": 1}, resume={"a"})
    for _ in range(2):
        sched.decode(["c", "a"])

    b, c = sched.reqs["b"], sched.reqs["c"]
    assert len(a.outputs) == 8 and len(b.outputs) == 5 and len(c.outputs) == 4
    assert a.outputs == _hf_greedy(hf, prompt_a, len(a.outputs))
    assert b.outputs == _hf_greedy(hf, prompt_b, len(b.outputs))
    assert c.outputs == _hf_greedy(hf, prompt_c, len(c.outputs))

    # Prompt logprobs: two chunks (6 then 3 rows), not repeated after the resume.
    chunks = sched.prompt_logprobs["a"]
    assert [len(x) for x in chunks] == [6, 3]
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt_a])).logits[0].log_softmax(-1)
    got = torch.cat(chunks).cpu()
    targets = torch.tensor(prompt_a[1:])
    torch.testing.assert_close(
        got[:, 0], ref[:-1].gather(1, targets[:, None])[:, 0], atol=1e-4, rtol=0
    )
    torch.testing.assert_close(got[:, 1:], ref[:-1].topk(3, dim=-1).values, atol=1e-4, rtol=0)


def test_empty_step_and_seeded_sampling(tiny: tuple[Path, LlamaForCausalLM]) -> None:
    path, _ = tiny
    runner = _make_runner(path)
    runner.execute_model(SchedulerOutput.empty())
    empty = runner.sample_tokens()
    assert empty.req_ids == [] and empty.sampled_token_ids == []
    assert empty.step_times is None  # no forward, nothing to time

    def run(seed: int) -> list[int]:
        sched = HandScheduler(runner)
        params = SamplingParams(temperature=1.0, seed=seed)
        req_id = f"s{seed}-{len(runner.requests)}"
        sched.reqs[req_id] = ReqTrack([3, 4, 5, 6, 7, 8], params)
        # A partial chunk first: it must not advance the request's generator.
        sched.step({req_id: 2})
        sched.step({req_id: 4})
        for _ in range(5):
            times = sched.decode([req_id]).step_times
            # The engine core's step-time totals add these up.
            assert times is not None and times.forward > 0
            assert times.prepare_inputs > 0 and times.sample > 0
        sched.finished.add(req_id)
        runner.execute_model(
            SchedulerOutput([], CachedRequestData(), {}, 0, finished_req_ids={req_id})
        )
        runner.sample_tokens()
        return sched.reqs[req_id].outputs

    first, again = run(1234), run(1234)
    assert first == again and len(first) == 6
    # Reference: the same generator drawing for an unchunked prompt gives the same tokens.
    sched = HandScheduler(runner)
    sched.reqs["whole"] = ReqTrack([3, 4, 5, 6, 7, 8], SamplingParams(temperature=1.0, seed=1234))
    sched.step({"whole": 6})
    for _ in range(5):
        sched.decode(["whole"])
    assert sched.reqs["whole"].outputs == first


def test_aborted_pooling_requests_leave_no_pooler_state(
    tiny: tuple[Path, LlamaForCausalLM],
) -> None:
    """Two pooling prompts aborted mid-prompt (no drafter configured): the pooler forgets
    both partial folds, not only the last one and not only when a drafter exists."""
    path, _ = tiny
    runner = _make_runner(path, runner="pooling", pooler_config=PoolerConfig("MEAN"))
    head = runner.output_head
    assert isinstance(head, PoolingHead)
    sched = HandScheduler(runner)
    for req_id in ("p", "q"):
        sched.reqs[req_id] = ReqTrack(list(range(3, 13)), SamplingParams(temperature=0.0))
    out = sched.step({"p": 4, "q": 4})
    assert out.pooler_output == {}
    assert head.prompt_pooler.pending_req_ids() == {"p", "q"}
    runner.execute_model(
        SchedulerOutput([], CachedRequestData(), {}, 0, finished_req_ids={"p", "q"})
    )
    runner.sample_tokens()
    assert "p" not in runner.requests and "q" not in runner.requests
    assert head.prompt_pooler.pending_req_ids() == set()


def test_default_model_weights_and_kv_cache_sit_on_huge_pages(llm: Any) -> None:
    """What a decode step streams from DRAM (the layers' blocks, the KV cache) is on huge
    pages where the kernel gives them (utils/huge_pages.py)."""
    llm.generate(["a few tokens"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner
    layers = runner.model.model.layers
    first = layers[0].mlp.gate_up_proj.quant_weight.qs
    last = layers[-1].self_attn.o_proj.quant_weight.qs
    # One region holds every moved weight.
    assert first.untyped_storage().data_ptr() == last.untyped_storage().data_ptr()
    cache = runner.kv_caches[next(iter(runner.kv_caches))]
    assert cache.data_ptr() % HUGE_PAGE_BYTES == 0
    if thp_enabled():
        assert anon_huge_bytes(first.data_ptr()) >= HUGE_PAGE_BYTES
        assert anon_huge_bytes(cache.data_ptr()) >= HUGE_PAGE_BYTES


def test_engines_one_after_another_leave_no_weights_behind() -> None:
    """Each engine's weights region is unmapped with the engine, though get_rope's shared
    tables (built by the first engine's forward) are in every later model too."""
    from kvserve import LLM

    for _ in range(2):
        engine = LLM(kv_cache_memory=64 << 20)
        engine.generate(["hi"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        runner = engine.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner
        region = runner.model.model.layers[0].mlp.gate_up_proj.quant_weight.qs
        start = region.untyped_storage().data_ptr()
        assert start in live_regions()
        engine.llm_engine.shutdown()
        del engine, runner, region
        gc.collect()
        assert start not in live_regions()
