"""ModelRunner: applies scheduler diffs to the persistent batch, runs the forward pass
over the paged KV cache and samples (the two-phase execute_model / sample_tokens API).

Composed, as vLLM's v2 model runner, of components that each own their state: the
request-state table (the one writer of sampled tokens), the KV connector, spec decode,
the encoder runner, the logits runner, LoRA and the output head (logits to sample, or
a pooling model's prompt pooler).
A feature that is off is a no-op component, not a branch.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvserve import _custom_ops as ops
from kvserve.attention.backends.abstract import AttentionMetadataBuilder
from kvserve.attention.layer import Attention, get_attention_layers
from kvserve.config import EngineConfig
from kvserve.distributed.kv_transfer.kv_connector.base import KVConnectorBase_V1
from kvserve.distributed.parallel_state import get_pp_group
from kvserve.forward_context import set_forward_context
from kvserve.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2, get_mamba_layers
from kvserve.model_executor.lora.model_manager import LoRAModelManager
from kvserve.model_executor.model_loader import get_model
from kvserve.protocol.kv_cache_interface import KVCacheConfig, KVCacheSpec
from kvserve.protocol.runner_output import (
    KVConnectorOutput,
    LogprobsLists,
    ModelRunnerOutput,
    RunnerStepTimes,
    empty_model_runner_output,
)
from kvserve.protocol.scheduler_output import GrammarOutput, SchedulerOutput
from kvserve.sample.sampler import Sampler
from kvserve.sample.sampling_batch import SamplingBatch
from kvserve.sample.spec_decode_metadata import SpecDecodeMetadata
from kvserve.utils.census import census_of, prefixed
from kvserve.worker.blend_runner import NO_BLEND_RUNNER, BlendRunner, make_blend_runner
from kvserve.worker.cuda_graph_runner import NoCUDAGraphs, make_cuda_graph_runner
from kvserve.worker.encoder_runner import make_encoder_runner
from kvserve.worker.greedy_head import NO_GREEDY_HEAD, GreedyHead, make_greedy_head
from kvserve.worker.input_batch import InputBatch
from kvserve.worker.input_preparation import InputPreparer, StepInputs
from kvserve.worker.kv_cache_binder import KVCacheBinder
from kvserve.worker.kv_cache_specs import enable_attention_sinks
from kvserve.worker.kv_connector import NO_OP_KV_CONNECTOR, KVConnector, get_kv_connector
from kvserve.worker.logits_runner import LogitsRunner
from kvserve.worker.lora_runner import ActiveLoRARunner, LoRARunner
from kvserve.worker.mamba_state_runner import (
    MambaStateRunner,
    make_mamba_state_runner,
)
from kvserve.worker.output_head import make_output_head
from kvserve.worker.request_states import KeepsRequestState, RequestStates
from kvserve.worker.sleep_mode import WorkerSleepMode, named_module_tensors
from kvserve.worker.spec_decode_runner import make_spec_decode_runner
from kvserve.worker.thread_governor import StepThreadGovernor
from kvserve.worker.ubatch_runner import NO_UBATCH_RUNNER, UBatchRunner, make_ubatch_runner

logger = logging.getLogger(__name__)


@dataclass
class ExecuteModelState:
    """What execute_model leaves for sample_tokens."""

    scheduler_output: SchedulerOutput
    inputs: StepInputs | None  # None for an empty step
    logits: torch.Tensor | None  # [S, V]: one row per sampling row
    # Kept only when some request wants prompt logprobs in this step.
    hidden_states: torch.Tensor | None
    # The KV connector's report for this step (empty without a connector).
    kv_connector_output: KVConnectorOutput = dataclasses.field(default_factory=KVConnectorOutput)
    # Pooling runner: the vectors of the prompts that completed in this step.
    pooler_output: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    # Seconds before the forward (state update, inputs, attention metadata) and in it.
    prepare_time: float = 0.0
    forward_time: float = 0.0
    # Where the drafts' logits are (a step with drafts); logits then has n + 1 rows per row.
    spec_metadata: SpecDecodeMetadata | None = None
    # A greedy step's tokens when they came without logits (greedy_head.py): [S] int64.
    greedy_tokens: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device | str) -> None:
        self.config = config
        self.device = torch.device(device)
        model_config = config.model_config
        # The longest sequence (past the context in sink mode): sizes the batch buffers.
        self.max_model_len = config.max_seq_len
        self.max_num_reqs = config.scheduler_config.max_num_seqs
        self.max_num_tokens = config.scheduler_config.max_num_batched_tokens
        self.vocab_size = model_config.vocab_size
        # Resolved for the device by EngineConfig: float32 on a CPU, bfloat16 on CUDA by default.
        self.dtype: torch.dtype = getattr(torch, model_config.dtype)
        eos_ids = model_config.arch.eos_token_ids
        self.pin_memory = self.device.type == "cuda" and torch.cuda.is_available()
        # Pipeline parallelism: only the last stage computes logits and samples; the
        # others learn the sampled tokens from the scheduler (CachedRequestData).
        self.is_last_stage = get_pp_group().is_last_rank
        self.thread_governor = StepThreadGovernor.for_process()
        self.thread_governor.enabled &= self.device.type == "cpu"

        self.model: Any = None
        self.requests = RequestStates(self.device, eos_ids[0] if eos_ids else None)
        self.input_batch: InputBatch | None = None
        # The KV cache's tensors, their binding and the groups' metadata builders.
        self.kv_binder = KVCacheBinder(config, self.device)
        # Mamba layers: their states under speculative decoding (no-op without them).
        self.mamba_state: MambaStateRunner = MambaStateRunner()
        self.inputs = InputPreparer(
            self.max_num_reqs, self.max_num_tokens, self.device, self.pin_memory
        )
        self.sampler = Sampler()
        self.logits_runner = LogitsRunner(self.vocab_size)
        # A pooling model returns vectors instead of sampling; an earlier pipeline stage
        # returns neither (its hidden states go on to the next stage).
        self.output_head = make_output_head(model_config, self.is_last_stage)
        # Greedy steps' tokens without the logits, where the model can (set by load_model).
        self.greedy_head: GreedyHead = NO_GREEDY_HEAD
        self.execute_model_state: ExecuteModelState | None = None
        # The proposer and the RejectionSampler (a no-op without speculative_config).
        self.spec_decode = make_spec_decode_runner(config, self.device)
        self.drafter = self.spec_decode.drafter
        # enable_lora: the adapters' slots and the wrapped projections (after load_model).
        self.lora_runner = LoRARunner()
        # Multimodal models: the encoder cache and the merge of image embeddings.
        self.encoder_runner = make_encoder_runner(config, self.device)
        # Set with the KV caches (initialize_kv_cache); the no-op one until then.
        self.kv_connector_runner: KVConnector = NO_OP_KV_CONNECTOR
        # CacheBlend's segment reuse (the tiered connector's blending); no-op until then.
        self.blend_runner: BlendRunner = NO_BLEND_RUNNER
        # Decode steps replayed from CUDA graphs, captured with the KV cache; eager until then.
        self.cuda_graphs = NoCUDAGraphs()
        # Dual batch overlap (--enable-dbo): set with the KV cache's builders; no-op until then.
        self.ubatch_runner: UBatchRunner = NO_UBATCH_RUNNER
        # Sleep mode: the KV cache's (and the weights') memory handed back and returned.
        self.sleep_mode = WorkerSleepMode(
            kv_tensors=lambda: list(self.kv_caches.values()),
            weight_tensors=lambda: dict(named_module_tensors(self.model)),
            load_weights=lambda: dict(named_module_tensors(self._get_model())),
        )
        # Everything that keeps per-request state forgets finished requests through this.
        self._request_owners: dict[str, KeepsRequestState] = {
            "requests": self.requests,
            "drafter": self.drafter,
            "output_head": self.output_head,
        }

    @property
    def kv_caches(self) -> dict[str, torch.Tensor]:
        return self.kv_binder.kv_caches

    @property
    def attn_builders(self) -> list[AttentionMetadataBuilder]:
        return self.kv_binder.attn_builders

    @property
    def kv_connector(self) -> KVConnectorBase_V1 | None:
        """The worker-side connector (None: no KV transfer configured)."""
        return self.kv_connector_runner.connector

    # ---- setup ---------------------------------------------------------------------------

    def load_model(self) -> None:
        self.model = self._get_model()
        if self.config.cache_config.attention_sinks:
            cache = self.config.cache_config
            enable_attention_sinks(
                self._attention_layers(), cache.attention_sinks, self.config.sink_window
            )
        self.drafter.load_model()
        self.encoder_runner.set_model(self.model)
        self.greedy_head = make_greedy_head(
            self.model, self.is_last_stage, self.config.model_config.is_pooling
        )
        if self.config.lora_config is not None:
            manager = LoRAModelManager(self.model, self.config.lora_config)
            self.lora_runner = ActiveLoRARunner(manager)

    def _get_model(self) -> Any:
        """The target model loaded from its files (at start-up, and on waking from a
        level-2 sleep)."""
        mc = self.config.model_config
        quantization = mc.quantization
        if mc.quantization_is_default and (self.device.type != "cpu" or not ops.available()):
            # The default block path has C++ CPU kernels only; asked for, it would raise.
            logger.info("GGUF blocks need kvserve's CPU kernels: loading float32 weights")
            quantization = None
        arch = mc.arch
        if self.config.cache_config.attention_sinks:
            # Positions run past the context (see SinkFullAttentionSpec's position rule).
            arch = dataclasses.replace(
                arch, max_position_embeddings=max(arch.max_position_embeddings, self.max_model_len)
            )
        return get_model(mc.resolved, arch, self.device, self.dtype, quantization)

    def sleep(self, level: int) -> int:
        """Hands back the KV cache's memory, and the weights' at level 2 (sleep_mode.py);
        the bytes freed."""
        if level == 2 and self.config.lora_config is not None:
            # The adapters wrap the layers, so the reloaded model's tensors have other names.
            raise ValueError("sleep level 2 is not supported with enable_lora; use level 1")
        return self.sleep_mode.sleep(level)

    def _attention_layers(self) -> dict[str, Attention]:
        if self.model is None:
            raise RuntimeError("load_model() must run first")
        layers = get_attention_layers(self.model)
        # A draft model's layers get their own KV cache in the same blocks.
        layers.update(self.drafter.attention_layers())
        return layers

    def _mamba_layers(self) -> dict[str, MambaMixer2]:
        if self.model is None:
            raise RuntimeError("load_model() must run first")
        return get_mamba_layers(self.model)

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return self.kv_binder.get_kv_cache_spec(self._attention_layers(), self._mamba_layers())

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate and bind the cache (kv_cache_binder.py), then what reads it: the
        Mamba state runner, the drafter, the KV connector, the input batch."""
        mamba_layers = self._mamba_layers()
        self.kv_binder.bind(kv_cache_config, self.model, self._attention_layers(), mamba_layers)
        self.mamba_state = make_mamba_state_runner(mamba_layers)
        binder = self.kv_binder
        self.drafter.bind_kv_cache(binder.kv_caches, binder.attn_builders, binder.layer_to_group)
        self.kv_connector_runner = get_kv_connector(self.config, kv_cache_config, self.kv_caches)
        self.ubatch_runner = make_ubatch_runner(self.config.parallel_config, self.kv_binder)
        # Block tables fit the longest any group holds (a cross-attention group's encoder
        # output may be longer than the decoder's context).
        table_len = max(
            g.kv_cache_spec.max_num_blocks(self.max_model_len, self.max_num_tokens)
            * g.kv_cache_spec.block_size
            for g in kv_cache_config.kv_cache_groups
        )
        self.blend_runner = make_blend_runner(
            self.config, self.model, kv_cache_config, self.kv_caches, self.kv_connector
        )
        self.input_batch = InputBatch(
            max_num_reqs=self.max_num_reqs,
            max_model_len=self.max_model_len,
            max_block_table_len=table_len,
            max_num_batched_tokens=self.max_num_tokens,
            device=self.device,
            block_sizes=[g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups],
            sampling_batch=SamplingBatch(self.max_num_reqs, self.vocab_size, self.device),
            pin_memory=self.pin_memory,
        )
        self.requests.bind_batch(self.input_batch)
        widths = [t.max_num_blocks_per_req for t in self.input_batch.block_table.block_tables]
        self.cuda_graphs = make_cuda_graph_runner(
            self.config, self.device, self.attn_builders, binder.layer_to_group, widths
        )
        self.cuda_graphs.capture(self.model)

    def request_census(self) -> dict[str, int]:
        """Live per-request entries of every owner in the runner (see utils/census.py)."""
        census = census_of(self._request_owners)
        if self.input_batch is not None:
            census.update(prefixed("input_batch", self.input_batch.request_census()))
        return census

    def shutdown(self) -> None:
        self.encoder_runner.shutdown()
        self.kv_connector_runner.shutdown()
        self.ubatch_runner.shutdown()

    # ---- per step: state ------------------------------------------------------------------

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        batch = self.input_batch
        if batch is None:
            raise RuntimeError("initialize_kv_cache() must run before execute_model()")
        finished = scheduler_output.finished_req_ids
        if finished:
            for owner in self._request_owners.values():
                owner.remove_requests(finished)
        # Preempted and otherwise unscheduled requests leave the batch but keep their state.
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id in [r for r in batch.req_id_to_index if r not in scheduled]:
            batch.remove_request(req_id)

        to_add = []
        for new in scheduler_output.scheduled_new_reqs:
            batch.remove_request(new.req_id)  # a re-sent request replaces the old state
            to_add.append(self.requests.add(new))

        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            new_block_ids = cached.new_block_ids[i]
            if cached.resumed_from_preemption[i]:
                assert new_block_ids is not None, f"{req_id} resumed without blocks"
                state.block_ids = tuple(list(ids) for ids in new_block_ids)
            elif new_block_ids is not None:
                for ids, new_ids in zip(state.block_ids, new_block_ids, strict=True):
                    ids.extend(new_ids)
            if not self.is_last_stage:
                self.requests.take_new_token_ids(state, cached.new_token_ids[i])
            if len(state.output_token_ids) > cached.num_output_tokens[i]:
                # The scheduler dropped a token sampled over KV whose load failed.
                self.requests.truncate(state, cached.num_output_tokens[i])
            row = batch.req_id_to_index.get(req_id)
            if row is None:
                to_add.append(state)
                continue
            batch.num_computed_tokens_cpu[row] = state.num_computed_tokens
            if cached.resumed_from_preemption[i]:
                batch.block_table.add_row(state.block_ids, row)
            elif new_block_ids is not None:
                batch.block_table.append_row(new_block_ids, row)

        for state in to_add:
            batch.add_request(state)
        batch.condense()
        self.spec_decode.write_spec_tokens(batch, scheduler_output)

    # ---- per step: forward ----------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        start = time.perf_counter()
        self._update_states(scheduler_output)
        self.encoder_runner.execute_mm_encoder(scheduler_output, self.requests)
        batch = self.input_batch
        assert batch is not None
        if scheduler_output.total_num_scheduled_tokens == 0 or batch.num_reqs == 0:
            # Connector transfers still progress (and get reported) in a step without tokens.
            kv_output = self.kv_connector_runner.no_forward(scheduler_output)
            self.execute_model_state = ExecuteModelState(
                scheduler_output, None, None, None, kv_output
            )
            return
        inputs = self.inputs.prepare(
            batch,
            scheduler_output.num_scheduled_tokens,
            scheduler_output.total_num_scheduled_tokens,
            ()
            if self.config.model_config.disable_cascade_attn
            else scheduler_output.num_common_prefix_blocks,
        )
        spec_metadata = self.spec_decode.spec_decode_metadata(batch, scheduler_output, inputs)
        unsplit = list(inputs.common_attn_metadata)
        self.spec_decode.split_spec_rows(batch, scheduler_output, inputs)
        attn_metadata = self.kv_binder.build_metadata(inputs.common_attn_metadata, unsplit)
        self.mamba_state.prepare(attn_metadata, batch, scheduler_output)
        mm_kwargs = self.encoder_runner.model_kwargs(batch, inputs, attn_metadata)
        self.lora_runner.set_active_loras(batch, inputs.num_scheduled_tokens)
        forward_start = time.perf_counter()
        self.thread_governor.begin(scheduler_output.total_num_scheduled_tokens)
        kv_connector = self.kv_connector_runner
        with (
            set_forward_context(attn_metadata, kv_connector=kv_connector.connector) as context,
            kv_connector.step(scheduler_output) as kv_output,
        ):
            self.blend_runner.begin_step(context, scheduler_output, batch, inputs)
            hidden_states = self.ubatch_runner.forward(
                self.model, inputs, mm_kwargs, self.cuda_graphs.forward
            )
            self.blend_runner.end_step()
        greedy_tokens = self.greedy_head.tokens(hidden_states, batch, inputs, spec_metadata)
        logits, pooler_output = (
            self.output_head.compute(self.model, hidden_states, batch, inputs, spec_metadata)
            if greedy_tokens is None
            else (None, {})
        )
        if self.device.type == "cuda":
            # Kernels run asynchronously: without this the forward's time would show up in
            # sampling, whose .cpu() waits for it moments later anyway.
            torch.cuda.synchronize(self.device)
        forward_end = time.perf_counter()
        self.thread_governor.end()
        keep_hidden = (
            hidden_states
            if self.is_last_stage and self.logits_runner.wants_prompt_logprobs(batch)
            else None
        )
        self.execute_model_state = ExecuteModelState(
            scheduler_output,
            inputs,
            logits,
            keep_hidden,
            kv_output,
            pooler_output=pooler_output,
            prepare_time=forward_start - start,
            forward_time=forward_end - forward_start,
            spec_metadata=spec_metadata,
            greedy_tokens=greedy_tokens,
        )

    # ---- per step: sampling ---------------------------------------------------------------

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        start = time.perf_counter()
        state, self.execute_model_state = self.execute_model_state, None
        if state is None:
            raise RuntimeError("sample_tokens() called without a preceding execute_model()")
        if not self.is_last_stage:
            return empty_model_runner_output()  # the last stage samples and replies
        if state.inputs is None:
            output = empty_model_runner_output()
            output.kv_connector_output = _reported(state.kv_connector_output)
            return output
        batch = self.input_batch
        assert batch is not None
        inputs = state.inputs
        num_reqs = batch.num_reqs
        req_ids = batch.req_ids
        sample_rows = inputs.sample_rows

        sampled_token_ids: list[list[int]] = [[] for _ in range(num_reqs)]
        logprobs: LogprobsLists | None = None
        logprobs_row_starts: list[int] | None = None
        # Tokens with KV before this step (the proposer's drafter catches up from there).
        num_computed_before = batch.num_computed_tokens_cpu.copy()
        logits_runner = self.logits_runner
        if state.spec_metadata is not None and state.logits is not None:
            if grammar_output is not None:
                logits_runner.apply_grammar_bitmask(
                    batch,
                    state.logits,
                    sample_rows,
                    grammar_output,
                    state.spec_metadata.cu_num_logits,
                )
            spec_out = self.spec_decode.verify(
                state.spec_metadata,
                state.logits,
                sample_rows,
                lambda rows: batch.sampling_batch.make_sampling_metadata(
                    num_reqs, torch.from_numpy(rows)
                ),
            )
            self.requests.append_sampled_lists(
                sample_rows, spec_out.sampled_token_ids, sampled_token_ids
            )
            self.mamba_state.commit(sampled_token_ids)
            if spec_out.logprobs_tensors is not None:
                logprobs = spec_out.logprobs_tensors.tolists()
                logprobs_row_starts = self.spec_decode.logprobs_row_starts(
                    sample_rows, spec_out.sampled_token_ids, num_reqs
                )
        elif state.greedy_tokens is not None:
            tokens = state.greedy_tokens.numpy()
            self.requests.append_sampled(sample_rows, tokens.astype(np.int32), sampled_token_ids)
        elif state.logits is not None:
            rows = None if len(sample_rows) == num_reqs else torch.from_numpy(sample_rows)
            metadata = batch.sampling_batch.make_sampling_metadata(num_reqs, rows)
            if grammar_output is not None:
                logits_runner.apply_grammar_bitmask(
                    batch, state.logits, sample_rows, grammar_output
                )
            out = self.sampler(state.logits, metadata)
            sampled = out.sampled_token_ids
            tokens = (sampled if sampled.is_cpu else sampled.cpu()).numpy()
            self.requests.append_sampled(sample_rows, tokens.astype(np.int32), sampled_token_ids)
            if out.logprobs_tensors is not None:
                logprobs = logits_runner.logprobs_by_row(
                    out.logprobs_tensors, sample_rows, num_reqs
                )

        output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index=dict(batch.req_id_to_index),
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs,
            prompt_logprobs_dict=logits_runner.prompt_logprobs(
                batch, inputs, state.hidden_states, self.model
            ),
            logprobs_row_starts=logprobs_row_starts,
            spec_token_ids=self.spec_decode.propose_draft_token_ids(
                batch, sample_rows, num_computed_before
            ),
            pooler_output=state.pooler_output,
        )
        output.encoder_stats = self.encoder_runner.take_encoder_stats()
        output.step_times = RunnerStepTimes(
            state.prepare_time, state.forward_time, time.perf_counter() - start
        )
        output.kv_connector_output = _reported(state.kv_connector_output)
        return output


def _reported(kv_output: KVConnectorOutput) -> KVConnectorOutput | None:
    """The connector's report, or None when it has nothing to say (most steps)."""
    return None if kv_output.is_empty() else kv_output
