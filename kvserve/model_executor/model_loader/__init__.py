"""Build a model for a resolved checkpoint and fill its weights."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn

from kvserve.distributed.parallel_state import get_pp_group, get_tp_group
from kvserve.model_executor.layers.quantization import attach_gguf_blocks, quantize_model
from kvserve.model_executor.model_loader.gguf_loader import iterate_gguf_weights
from kvserve.model_executor.model_loader.hf_loader import iterate_safetensors_weights
from kvserve.model_executor.models.registry import get_model_cls
from kvserve.transformers_utils.arch_config import ArchConfig
from kvserve.transformers_utils.model_resolver import ResolvedModel
from kvserve.utils.huge_pages import module_tensors, move_to_huge_pages

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def get_model(
    resolved: ResolvedModel,
    arch: ArchConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    quantization: str | None = None,
) -> nn.Module:
    """Instantiate ``arch.architecture`` directly on ``device`` (parameters are
    allocated there, not moved) and load the checkpoint into it, in eval mode; with
    ``quantization``, its linear layers then switch to GGUF block weights."""
    model_cls = get_model_cls(arch.architecture)
    tp_size = get_tp_group().world_size
    pp_size = get_pp_group().world_size
    if pp_size > 1 and not model_cls.__dict__.get("supports_pipeline_parallel", False):
        raise ValueError(
            f"{arch.architecture} does not support pipeline parallelism yet "
            f"(pipeline_parallel_size={pp_size})"
        )
    # Only families whose every layer shards (and that tests compare with TP=1) say so.
    if tp_size > 1 and not model_cls.__dict__.get("supports_tensor_parallel", False):
        raise ValueError(
            f"{arch.architecture} does not support tensor parallelism yet "
            f"(tensor_parallel_size={tp_size})"
        )
    if tp_size > 1:
        for what, count in (
            ("num_attention_heads", arch.num_attention_heads),
            ("intermediate_size", arch.intermediate_size),
        ):
            if count % tp_size:
                raise ValueError(f"tensor_parallel_size={tp_size} does not divide {what}={count}")
        kv = arch.num_key_value_heads
        if kv % tp_size and tp_size % kv:
            raise ValueError(
                f"tensor_parallel_size={tp_size} and num_key_value_heads={kv}: one must "
                "divide the other"
            )
    # Constructing under the device context also makes Attention pick the backend
    # for that device.
    with torch.device(device), _default_dtype(dtype):
        model = model_cls(arch)
    if quantization is not None and torch.device(device).type != "cpu":
        raise ValueError(f"quantization {quantization!r} has CPU kernels only, not {device}")
    prepared: dict[str, torch.Tensor] | None = None
    if resolved.format == "gguf":
        # The file's own blocks go in first, so the layers they serve never get (and
        # dequantize) float32 weights: the largest part of loading a GGUF model.
        if quantization in ("gguf", "gguf_int8"):
            prepared = attach_gguf_blocks(model, quantization, resolved.path, arch)
        weights = iterate_gguf_weights(resolved.path, arch, prepared)
    else:
        weights = iterate_safetensors_weights(resolved.path)
    # Every weight arrives in float32 (GGUF blocks dequantized once, losslessly) or the
    # checkpoint's type; the parameters' copy_ casts it once to ``dtype`` (bfloat16 on CUDA
    # by default), so no float32 copy of the model stays on the device.
    model.load_weights(weights)  # type: ignore[operator]
    if quantization is not None and prepared is None:
        gguf_path = resolved.path if resolved.format == "gguf" else None
        quantize_model(model, quantization, gguf_path, arch)
    if torch.device(device).type == "cpu":
        # A decode step streams every weight from DRAM: on huge pages (utils/huge_pages).
        moved = move_to_huge_pages(module_tensors(model))
        logger.info("weights on huge pages: %.1f MB", moved / 1e6)
    return model.eval()


__all__ = ["get_model"]
