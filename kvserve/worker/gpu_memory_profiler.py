"""gpu_memory_utilization on CUDA, as vLLM means it (gpu_worker.determine_available_memory):
the share of the device's total memory this instance may use, of which the KV cache gets
what the weights, the largest step's activations, the decode CUDA graphs' pools and the
memory torch does not manage leave.

The worker takes a snapshot when it claims the device (failing at once when other
processes hold more than the share leaves), then, after loading and before the KV cache
exists: runs the largest step eagerly without a cache (profile_forward), captures the
largest and the smallest decode graph over a two-block probe cache and scales them to
every capture size (estimate_cuda_graph_bytes), frees both, and hands the measurements to
kv_cache_budget (utils/memory.py, pure arithmetic). After the real capture it logs the
estimate beside what the graphs took.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import torch

from kvserve.attention.layer import bind_kv_cache, get_attention_layers
from kvserve.config import EngineConfig
from kvserve.distributed.parallel_state import get_pp_group
from kvserve.forward_context import set_forward_context
from kvserve.protocol.kv_cache_interface import KVCacheConfig, build_kv_cache_config
from kvserve.utils.memory import (
    MemoryProfile,
    cuda_graph_estimate,
    kv_cache_budget,
    requested_memory,
)
from kvserve.worker.cuda_graph_runner import (
    CUDAGraphRunner,
    graphs_unsupported,
    make_cuda_graph_runner,
)
from kvserve.worker.kv_cache_binder import KVCacheBinder

logger = logging.getLogger(__name__)

_MiB = float(1 << 20)
# The probe cache's blocks: the null block and one more (the padding rows read block 0).
_PROBE_BLOCKS = 2


@torch.inference_mode()
def profile_forward(
    model: Any,
    num_tokens: int,
    num_reqs: int,
    max_model_len: int,
    device: torch.device,
    with_logits: bool = True,
) -> torch.Tensor:
    """The largest step the scheduler may send, run eagerly without a KV cache (the
    attention layers treat the tokens as one causal sequence), then the logits and
    probabilities of ``num_reqs`` rows as the sampler would make them. Returns the
    probabilities; the hidden states where nothing is sampled (a pooling model, or
    ``with_logits`` False: an earlier pipeline stage, whose forward sends them on while
    every rank profiles at once, so the stages' sends and receives pair up)."""
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    positions = torch.arange(num_tokens, dtype=torch.int64, device=device) % max_model_len
    with set_forward_context(None):
        hidden = model(input_ids, positions)
    compute_logits = getattr(model, "compute_logits", None)
    if compute_logits is None or not with_logits:
        return hidden
    return torch.softmax(compute_logits(hidden[-num_reqs:]).float(), dim=-1)


def estimate_cuda_graph_bytes(config: EngineConfig, device: torch.device, model: Any) -> int:
    """What the decode graphs of every capture size will hold, before the KV cache is
    allocated: the largest and the smallest size captured into one pool over a probe
    cache, scaled (vLLM's estimate); 0 where this engine captures none. The probe's
    graphs are released and the layers left unbound; the caller empties torch's cache."""
    sizes = sorted(config.compilation_config.cudagraph_capture_sizes or [])
    # The features that keep graphs off whatever the backend (Mamba-only models, say,
    # have no attention layer to bind a probe cache to).
    if device.type != "cuda" or not sizes or graphs_unsupported(config, []):
        return 0
    layers = get_attention_layers(model)
    binder = KVCacheBinder(config, device)
    probe_config = build_kv_cache_config(
        binder.get_kv_cache_spec(layers, {}), 0, num_blocks_override=_PROBE_BLOCKS
    )
    binder.bind(probe_config, model, layers, {})
    probe: CUDAGraphRunner | None = None
    try:
        table_len = max(config.max_seq_len, _block_table_len(config, probe_config))
        widths = [-(-table_len // g.kv_cache_spec.block_size) for g in probe_config.kv_cache_groups]
        runner = make_cuda_graph_runner(
            config, device, binder.attn_builders, binder.layer_to_group, widths
        )
        if not isinstance(runner, CUDAGraphRunner):
            return 0
        probe_sizes = sorted({sizes[0], sizes[-1]})
        probe = CUDAGraphRunner(probe_sizes, runner.builders, runner.layer_to_group, runner.static)
        probe.capture(model)
        marginal = probe.size_bytes[sizes[0]] if len(probe_sizes) == 2 else 0
        return cuda_graph_estimate(probe.size_bytes[sizes[-1]], marginal, len(sizes))
    finally:
        if probe is not None:
            probe.release()
        bind_kv_cache(model, {name: torch.empty(0) for name in layers})
        binder.kv_caches.clear()


def _block_table_len(config: EngineConfig, kv_config: KVCacheConfig) -> int:
    """The token span of a block table row, as the model runner sizes its input batch."""
    max_tokens = config.scheduler_config.max_num_batched_tokens
    return max(
        g.kv_cache_spec.max_num_blocks(config.max_seq_len, max_tokens) * g.kv_cache_spec.block_size
        for g in kv_config.kv_cache_groups
    )


class GPUMemoryProfiler:
    """One CUDA worker's memory accounting for gpu_memory_utilization. Made when the
    worker claims its device, before anything of the model is on it."""

    def __init__(self, utilization: float, device: torch.device) -> None:
        self.utilization = utilization
        self.device = device
        free, total = torch.cuda.mem_get_info(device)
        self.total, self.free_at_start = int(total), int(free)
        # What torch does not manage at start (other processes, this one's context): the
        # baseline of the non-torch growth.
        self.untracked_at_start = (self.total - self.free_at_start) - torch.cuda.memory_reserved(
            device
        )
        requested_memory(utilization, self.total, self.free_at_start)  # fail before loading
        self.profile: MemoryProfile | None = None

    def kv_cache_budget(self, model: Any, config: EngineConfig) -> int:
        """Profiles the loaded model (see the module docstring); the KV cache's bytes."""
        device = self.device
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        weights = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        sched = config.scheduler_config
        num_tokens = sched.max_num_batched_tokens
        num_reqs = min(sched.max_num_seqs, num_tokens)
        last_stage = get_pp_group().is_last_rank
        profile_forward(model, num_tokens, num_reqs, config.max_seq_len, device, last_stage)
        torch.cuda.synchronize(device)
        peak_activations = max(0, torch.cuda.max_memory_allocated(device) - weights)
        torch.cuda.empty_cache()
        cuda_graphs = estimate_cuda_graph_bytes(config, device, model)
        # The probe's pool, cache and buffers go back to the device before the baseline.
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free = int(torch.cuda.mem_get_info(device)[0])
        untracked = (self.total - free) - torch.cuda.memory_reserved(device)
        self.profile = MemoryProfile(
            total=self.total,
            free_at_start=self.free_at_start,
            weights=weights,
            peak_activations=peak_activations,
            cuda_graphs=cuda_graphs,
            non_torch=max(0, untracked - self.untracked_at_start),
        )
        budget = kv_cache_budget(self.utilization, self.profile)
        p = self.profile
        logger.info(
            "gpu_memory_utilization=%s of %.0f MiB: weights %.0f MiB, activation peak %.0f "
            "MiB (%d tokens), CUDA graphs %.0f MiB (estimated), non-torch %.0f MiB; "
            "KV cache %.0f MiB",
            self.utilization, p.total / _MiB, p.weights / _MiB, p.peak_activations / _MiB,
            num_tokens, p.cuda_graphs / _MiB, p.non_torch / _MiB, budget / _MiB,
        )  # fmt: skip
        return budget

    def report_capture(self, captured_bytes: int) -> None:
        """Logs the graphs' estimate (counted in the budget) beside what they took."""
        if self.profile is None:
            return
        estimate = self.profile.cuda_graphs
        logger.info(
            "CUDA graphs: %.0f MiB estimated before the KV cache, %.0f MiB captured (%+.0f MiB)",
            estimate / _MiB, captured_bytes / _MiB, (captured_bytes - estimate) / _MiB,
        )  # fmt: skip
