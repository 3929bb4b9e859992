"""CUDA graphs for decode-only steps (vLLM's full CUDA graph mode for uniform decodes).

At start-up, after the KV cache is allocated, one graph is captured per size of
``cudagraph_capture_sizes`` (largest first, one shared memory pool): the model's forward
over a padded decode batch in StaticDecodeInputs' buffers. A later step whose requests
each add one token, and whose count fits a captured size, is copied into those buffers
and replayed: one launch instead of a few hundred. Every other step runs eagerly.

``NoCUDAGraphs`` is the form on a CPU, with --enforce-eager, and wherever a feature
does per-layer host work inside the forward (KV connectors, LoRA, multimodal inputs,
Mamba states, speculative decoding, pipeline or tensor parallelism): it calls the model.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from kvserve.attention.backends.abstract import AttentionMetadataBuilder
from kvserve.config import EngineConfig
from kvserve.forward_context import set_forward_context
from kvserve.worker.cuda_graph_inputs import StaticDecodeInputs, is_uniform_decode, padded_size
from kvserve.worker.input_preparation import StepInputs

logger = logging.getLogger(__name__)


class NoCUDAGraphs:
    """The eager forward: what every step runs without captured graphs."""

    # Device memory the captured graphs hold (0: none captured).
    pool_bytes = 0

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        return ()

    def capture(self, model: Any) -> None:
        pass  # nothing to capture

    def forward(self, model: Any, inputs: StepInputs, mm_kwargs: dict[str, Any]) -> torch.Tensor:
        return model(inputs.input_ids, inputs.positions, **mm_kwargs)


class CUDAGraphRunner(NoCUDAGraphs):
    def __init__(
        self,
        capture_sizes: list[int],
        builders: list[AttentionMetadataBuilder],
        layer_to_group: dict[str, int],
        static_inputs: StaticDecodeInputs,
    ) -> None:
        self.capture_sizes = sorted(capture_sizes)
        self.builders = builders
        self.layer_to_group = layer_to_group
        self.static = static_inputs
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.size_bytes: dict[int, int] = {}

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.graphs))

    def _metadata(self, size: int) -> Any:
        per_group = [
            builder.build(common)
            for builder, common in zip(
                self.builders, self.static.common_metadata(size), strict=True
            )
        ]
        if len(per_group) == 1:
            return per_group[0]
        return {name: per_group[g] for name, g in self.layer_to_group.items()}

    @torch.inference_mode()
    def capture(self, model: Any) -> None:
        """Capture every size, largest first so the smaller ones reuse its pool's blocks.
        Each is run once eagerly before its capture: Triton compiles outside the graph.
        ``size_bytes`` is the device memory each capture took, measured after its eager
        run so the activations that run leaves in torch's cache are not counted."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        static = self.static
        for size in reversed(self.capture_sizes):
            metadata = self._metadata(size)
            with set_forward_context(metadata):
                model(static.input_ids[:size], static.positions[:size])
                torch.cuda.synchronize()
                free_before = torch.cuda.mem_get_info()[0]
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = model(static.input_ids[:size], static.positions[:size])
                torch.cuda.synchronize()
            self.size_bytes[size] = max(0, free_before - torch.cuda.mem_get_info()[0])
            self.graphs[size] = graph
        self.pool_bytes = sum(self.size_bytes.values())
        logger.info(
            "captured %d CUDA graphs (decode batches %d..%d) in %.1f s, %.0f MiB",
            len(self.graphs), self.capture_sizes[0], self.capture_sizes[-1],
            time.perf_counter() - start, self.pool_bytes / (1 << 20),
        )  # fmt: skip

    def release(self) -> None:
        """Drops the graphs and their outputs, so their pool can go back to the device."""
        self.graphs.clear()
        self.outputs.clear()

    def forward(self, model: Any, inputs: StepInputs, mm_kwargs: dict[str, Any]) -> torch.Tensor:
        commons = inputs.common_attn_metadata
        n = int(inputs.input_ids.shape[0])
        size = padded_size(self.capture_sizes, n) if is_uniform_decode(commons[0]) else None
        if size is None or mm_kwargs or size not in self.graphs:
            return super().forward(model, inputs, mm_kwargs)
        self.static.load(inputs.input_ids, inputs.positions, commons, size)
        self.graphs[size].replay()
        # The padding rows' outputs are dropped here, before logits and sampling.
        return self.outputs[size][:n]


def graphs_unsupported(config: EngineConfig, builders: list[AttentionMetadataBuilder]) -> str:
    """Why this engine cannot replay graphs ("" when it can): per-layer host work in the
    forward (connectors, LoRA, encoders, Mamba, drafts, collectives) or moving buffers."""
    if not all(type(b).cudagraph_support for b in builders):
        names = sorted({type(b).__name__ for b in builders})
        return f"attention metadata builders {names} do work on the host per step"
    features = {
        "a KV connector": config.kv_transfer_config is not None,
        "LoRA": config.lora_config is not None,
        "speculative decoding": config.speculative_config is not None,
        "a multimodal model": config.model_config.arch.multimodal is not None,
        "Mamba layers": config.model_config.arch.mamba is not None,
        "parallel workers": config.parallel_config.distributed_world_size > 1,
        "attention sinks": config.cache_config.attention_sinks > 0,
        "a pooling model": config.model_config.is_pooling,
        # A level-1 sleep frees the KV cache the graphs recorded the addresses of.
        "sleep mode": config.model_config.enable_sleep_mode,
    }
    on = [name for name, used in features.items() if used]
    return f"not captured with {', '.join(on)}" if on else ""


def make_cuda_graph_runner(
    config: EngineConfig,
    device: torch.device,
    builders: list[AttentionMetadataBuilder],
    layer_to_group: dict[str, int],
    block_table_widths: list[int],
) -> NoCUDAGraphs:
    """The graph runner for this engine, or the eager one (logged once, with why)."""
    sizes = config.compilation_config.cudagraph_capture_sizes or []
    if device.type != "cuda" or not sizes:
        return NoCUDAGraphs()
    why = graphs_unsupported(config, builders)
    if why:
        logger.info("CUDA graphs off: %s; every step runs eagerly", why)
        return NoCUDAGraphs()
    static = StaticDecodeInputs(max(sizes), block_table_widths, config.max_seq_len, device)
    return CUDAGraphRunner(sizes, builders, layer_to_group, static)
