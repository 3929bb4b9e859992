"""Linear weights kept as llama.cpp's 32-weight blocks (``--quantization``).

Decode on a CPU is bound by reading weights: float32 SmolLM2 streams 0.54 GB per step.
Keeping the GGUF file's own Q4_1 / Q8_0 / Q4_0 blocks cuts that 4-8x, and the C++
kernel (``block_linear``) multiplies straight from them. Methods:

* ``gguf``: the blocks exactly as stored in the model's GGUF file. Lossless: they are
  taken before any float32 weight is built, and sampled rows of every tensor are checked
  to dequantize, bit for bit, as gguf's reference does (the float32 engine's weights);
  quantize_model checks every block of an already loaded model the same way. Tensors
  stored in other formats stay float32.
* ``gguf_int8``: the same blocks, but inputs are quantized to int8 per 32 values and
  multiplied in integer SIMD, as llama.cpp's CPU backend does, at an accuracy cost
  measured as greedy agreement with float32 (``kvserve bench quantization``). With
  AVX-512 VNNI or AVX2 a row-interleaved copy of the blocks serves every input, prefill
  and batches included (VNNI: 2-6x the float path's speed at 4-512 rows; AVX2: Q4_1
  1.9-2.8x at 4-64 rows, single rows 1.2-1.9x the plain layout's), and a row's
  result does not depend on the rows beside it. Without either only inputs of up to 3
  rows (single-stream decode) take the integer path; larger ones the exact float path.
* ``gguf`` and ``q8_0`` blocks are reordered once at load for this build's lossless
  kernels (block_weight.py): interleaved for the digit matmul on AVX-512 VNNI (on AVX2
  the 4-bit types only), nibble planes for AVX2's float GEMV (its other Q4 weights); the load-time check dequantizes the reordered blocks.
* ``q8_0``: quantize any model's float32 weights to Q8_0 blocks (gguf's own quantizer);
  this one costs accuracy, measured as greedy agreement with float32.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Container
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from torch import nn

from kvserve import _custom_ops as ops
from kvserve.config import QUANTIZATION_METHODS
from kvserve.model_executor.layers.block_weight import (
    SUPPORTED_TYPES,
    BlockWeight,
    LinearBlocks,
    concat_rows,
)
from kvserve.model_executor.layers.greedy_screen import GreedyScreen, screen_wanted

if TYPE_CHECKING:
    from kvserve.transformers_utils.arch_config import ArchConfig

__all__ = [
    "QUANTIZATION_METHODS",
    "attach_gguf_blocks",
    "quantize_model",
]

logger = logging.getLogger(__name__)


def _targets(model: nn.Module) -> dict[str, Any]:
    """Modules whose weight can become blocks: every linear layer and the LM head."""
    from kvserve.model_executor.layers.linear import LinearBase
    from kvserve.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, LinearBase | ParallelLMHead)
    }


def _fused_shards(model: nn.Module) -> dict[str, list[str]]:
    """Fused module leaf name -> its checkpoint shards in order (qkv_proj -> q, k, v)."""
    stacked: dict[str, list[str]] = {}
    for ckpt_part, (param_part, _) in getattr(model, "stacked_params", {}).items():
        stacked.setdefault(param_part.strip("."), []).append(ckpt_part.strip("."))
    return stacked


def _gguf_block_names(
    name: str, blocks: Container[str], stacked: dict[str, list[str]], tied: bool
) -> list[str] | None:
    """The checkpoint tensors holding one module's blocks: its own, its fused shards in
    order, or the tied embedding for an LM head. None when some part is not blocks."""
    if f"{name}.weight" in blocks:
        return [f"{name}.weight"]
    if tied:
        embedding = name.removesuffix("lm_head") + "model.embed_tokens.weight"
        return [embedding] if embedding in blocks else None
    prefix, _, leaf = name.rpartition(".")
    shard_names = [f"{prefix}.{shard}.weight" for shard in stacked.get(leaf, [])]
    if not shard_names or any(n not in blocks for n in shard_names):
        return None
    return shard_names


def _fused_shard_ids(model: nn.Module) -> dict[str, list[str | int]]:
    """Fused module leaf name -> the shard id of each checkpoint part, in order."""
    ids: dict[str, list[str | int]] = {}
    for param_part, shard_id in getattr(model, "stacked_params", {}).values():
        ids.setdefault(param_part.strip("."), []).append(shard_id)
    return ids


def _rank_blocks(
    module: Any, raw: np.ndarray, qtype: GGMLQuantizationType, shard_id: str | int | None
) -> np.ndarray | None:
    """This TP rank's part of a ``[rows, row bytes]`` block tensor: a run of rows for a
    column-parallel layer (padded with zero blocks to a vocab partition), a run of whole
    blocks of each row for a row-parallel one. None where the rank's columns do not start
    and end on block boundaries (that layer then stays float32)."""
    where = module.shard_range(2, shard_id) if module.tp_size > 1 else None
    if where is None:
        return raw
    dim, start, size = where
    if dim == 0:
        rows = raw[start : start + size]
        want = module.weight.shape[0] if hasattr(module, "num_embeddings_per_partition") else size
        if rows.shape[0] < want:  # the last vocab partition's padding rows are zero
            pad = np.zeros((want - rows.shape[0], raw.shape[1]), dtype=raw.dtype)
            rows = np.concatenate([rows, pad])
        return rows
    block, type_size = GGML_QUANT_SIZES[qtype]
    if start % block or size % block:
        return None
    return np.ascontiguousarray(
        raw[:, start // block * type_size : (start + size) // block * type_size]
    )


def _gguf_blocks_for(
    name: str, blocks: dict[str, BlockWeight], stacked: dict[str, list[str]], tied: bool
) -> LinearBlocks | None:
    names = _gguf_block_names(name, blocks, stacked, tied)
    if names is None:
        return None
    return blocks[names[0]] if len(names) == 1 else concat_rows([blocks[n] for n in names])


def _screened_head(module: Any) -> bool:
    """An LM head on one TP rank where the greedy screen pays or is asked for
    (greedy_screen.py): it keeps the plain layout the screen's integer pass reads."""
    from kvserve.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    return isinstance(module, ParallelLMHead) and module.tp_size == 1 and screen_wanted()


def _prepare_kernels(module: Any, bw: LinearBlocks, method: str) -> None:
    bw.prepare_kernels(method, interleave=not _screened_head(module))


def _attach(module: Any, bw: LinearBlocks) -> None:
    """The module computes with ``bw`` from now on; a screened LM head with the lossless
    arithmetic also gets its greedy screen."""
    module.quant_weight = bw
    if _screened_head(module) and isinstance(bw, BlockWeight) and GreedyScreen.supports(bw):
        module.greedy_screen = GreedyScreen(bw, module.num_embeddings)


def quantize_model(model: nn.Module, method: str, gguf_path: str | None, arch: ArchConfig) -> None:
    """Give each linear layer (and the LM head) block weights and drop its float32 copy.

    ``gguf``: the file's blocks, each checked to dequantize to exactly the loaded weight.
    ``gguf_int8``: the same blocks, multiplied with int8 activations in small batches.
    ``q8_0``: the loaded float32 weights quantized to Q8_0.
    """
    ops.require()
    targets = _targets(model)
    blocks: dict[str, BlockWeight] = {}
    if method in ("gguf", "gguf_int8"):
        if gguf_path is None:
            raise ValueError(f"quantization {method!r} needs a GGUF model file")
        from kvserve.model_executor.model_loader.gguf_loader import iterate_gguf_blocks

        for hf_name, qtype, raw in iterate_gguf_blocks(gguf_path, arch):
            if qtype in SUPPORTED_TYPES:
                blocks[hf_name] = BlockWeight.from_raw(raw, qtype)
    elif method != "q8_0":
        raise ValueError(f"unknown quantization method {method!r}")

    stacked = _fused_shards(model)
    kept: list[str] = []
    for name, module in targets.items():
        weight: torch.Tensor = module.weight
        tied = name.endswith("lm_head") and arch.tie_word_embeddings
        if method == "q8_0":
            bw: LinearBlocks | None = BlockWeight.quantize(weight, GGMLQuantizationType.Q8_0)
        else:
            bw = _gguf_blocks_for(name, blocks, stacked, tied)
        if bw is None:
            kept.append(name)
            continue
        _prepare_kernels(module, bw, method)
        if method != "q8_0" and not torch.equal(bw.dequantize(), weight):
            raise RuntimeError(f"{name}: GGUF blocks do not reproduce the loaded weight")
        _attach(module, bw)
        if tied and method == "q8_0":
            # Q8_0 is lossy: the embedding keeps looking up the exact float32 table.
            continue
        empty = _blocks_placeholder(weight)
        if tied:  # the blocks equal the table bit for bit (checked above)
            assert isinstance(bw, BlockWeight)  # one tensor: the embedding's
            _look_up_from_blocks(model, weight, bw, empty)
        module.weight = empty
    if kept:
        logger.info("quantization %s: %d layers stay float32: %s", method, len(kept), kept[:4])


# Rows of every block weight (besides its first and last) whose blocks are checked at
# load against gguf's own dequantization, chosen by a generator seeded with the name.
CHECKED_ROWS = 16


# (name, the file's bytes, their GGUF type, the block weight made from them): the type
# differs from the weight's own where load repacked it (Q5_0 -> Q8_0 planes).
CheckedWeight = tuple[str, np.ndarray, GGMLQuantizationType, "BlockWeight"]


def check_sampled_rows(weights: list[CheckedWeight]) -> None:
    """Raise unless the kernel dequantizes sampled rows of each ``(name, raw, qtype,
    weight)`` (``raw`` being ``weight``'s file bytes of type ``qtype``) exactly as gguf's
    reference does, i.e. to the float32 engine's weights.

    Dequantization is one formula for every block, so a sample proves the formula and
    the plane layout (dequantize_rows reads each kind's own, interleaved or not);
    quantize_model checks every block of a loaded model (the tests run it on the packaged
    one)."""
    for name, raw, qtype, weight in weights:
        rows = raw.shape[0]
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        sampled = rng.choice(rows, size=min(rows, CHECKED_ROWS), replace=False)
        picks = np.unique(np.concatenate([[0, rows - 1], sampled]))
        reference = gguf_dequantize(raw[picks], qtype).astype(np.float32)
        ours = weight.dequantize_rows(torch.from_numpy(picks)).numpy()
        if (ours != reference).any():
            raise RuntimeError(f"{name}: the kernel dequantizes it unlike gguf")


def _kept_as_blocks(param: nn.Parameter, loaded: torch.Tensor, *shard: object) -> None:
    """weight_loader of a weight that lives only as blocks: load_weights hands it the
    empty placeholder attach_gguf_blocks prepared, never float32 values."""
    if loaded.numel():
        raise RuntimeError("float32 values loaded into a layer that holds GGUF blocks")


def _blocks_placeholder(weight: torch.Tensor) -> nn.Parameter:
    """The empty parameter of a weight that lives only as blocks (load_weights fills it
    with nothing); it keeps the weight's dtype, a tied embedding's lookups' dtype."""
    placeholder = nn.Parameter(
        torch.empty(0, dtype=weight.dtype, device=weight.device), requires_grad=False
    )
    placeholder.weight_loader = _kept_as_blocks  # type: ignore[attr-defined]
    return placeholder


def _look_up_from_blocks(
    model: nn.Module, weight: torch.Tensor, blocks: BlockWeight, placeholder: nn.Parameter
) -> None:
    """Every embedding lookup that reads ``weight`` (a tied LM head's table) takes its
    rows from ``blocks`` instead, and holds ``placeholder`` in the table's place."""
    from kvserve.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    for module in model.modules():
        if (
            isinstance(module, VocabParallelEmbedding)
            and not isinstance(module, ParallelLMHead)
            and module.weight is weight
        ):
            module.weight = placeholder
            module.row_blocks = blocks


def attach_gguf_blocks(
    model: nn.Module, method: str, gguf_path: str, arch: ArchConfig
) -> dict[str, torch.Tensor]:
    """``gguf`` / ``gguf_int8`` from a GGUF file, before load_weights: give each linear
    layer and the LM head the file's blocks, so their float32 weights are never built.

    Each layer's blocks must have its weight's shape, and pass check_sampled_rows.
    A tied LM head's embedding lookups dequantize their rows from the head's blocks
    (VocabParallelEmbedding.row_blocks), so no float32 table is built.
    Returns HF tensor name -> what load_weights gets for it instead of gguf's
    dequantization: an empty placeholder, every such weight being now only blocks.
    """
    if method not in ("gguf", "gguf_int8"):
        raise ValueError(f"quantization {method!r} does not take the file's blocks")
    ops.require()
    from kvserve.model_executor.model_loader.gguf_loader import iterate_gguf_blocks

    raws = {
        hf_name: (qtype, raw)
        for hf_name, qtype, raw in iterate_gguf_blocks(gguf_path, arch)
        if qtype in SUPPORTED_TYPES
    }
    stacked = _fused_shards(model)
    shard_ids = _fused_shard_ids(model)
    prepared: dict[str, torch.Tensor] = {}
    kept: list[str] = []
    checks: list[CheckedWeight] = []
    for name, module in _targets(model).items():
        weight: torch.Tensor = module.weight
        tied = name.endswith("lm_head") and arch.tie_word_embeddings
        names = _gguf_block_names(name, raws, stacked, tied)
        # This rank's part of each tensor (all of it without tensor parallelism).
        ids = shard_ids.get(name.rpartition(".")[2], [None]) if names and len(names) > 1 else [None]
        parts = (
            None
            if names is None
            else [
                _rank_blocks(module, raws[n][1], raws[n][0], i)
                for n, i in zip(names, ids, strict=True)
            ]
        )
        if names is None or parts is None or any(p is None for p in parts):
            kept.append(name)
            continue
        local = {n: (raws[n][0], p) for n, p in zip(names, parts, strict=True) if p is not None}
        qtypes = {local[n][0] for n in names}
        if len(qtypes) == 1:
            # Fused shards are joined as file bytes, with numpy: torch's parallel copies of
            # small tensors cost more than they move when the cores are busy.
            raw = (
                local[names[0]][1]
                if len(names) == 1
                else np.concatenate([local[n][1] for n in names])
            )
            whole = BlockWeight.from_raw(raw, next(iter(qtypes)))
            checks.append((name, raw, next(iter(qtypes)), whole))
            bw: LinearBlocks = whole
        else:  # Gemma's Q5_0 q/k beside a Q8_0 v (one kernel type once repacked), Llama
            # Q4_K_M's Q4_K q/k beside a Q6_K v (a MixedBlockWeight)
            shards = [BlockWeight.from_raw(local[n][1], local[n][0]) for n in names]
            checks += [(n, local[n][1], local[n][0], w) for n, w in zip(names, shards, strict=True)]
            bw = concat_rows(shards)
        if bw.shape != tuple(weight.shape):
            raise RuntimeError(f"{name}: GGUF blocks {bw.shape} for a {tuple(weight.shape)} weight")
        if tied:
            # The head's blocks hold this rank's rows of the table, padded as the
            # embedding's own weight is: its lookups dequantize their rows from them.
            placeholder = _blocks_placeholder(weight)
            assert isinstance(bw, BlockWeight)  # one tensor: the embedding's
            _look_up_from_blocks(model, weight, bw, placeholder)
            module.weight = placeholder
            prepared[names[0]] = placeholder.data
        else:
            placeholder = _blocks_placeholder(weight)
            module.weight = placeholder
            prepared.update((n, placeholder.data) for n in names)
        # Before check_sampled_rows: it checks the layout the kernels will read.
        _prepare_kernels(module, bw, method)
        _attach(module, bw)
    check_sampled_rows(checks)
    if kept:
        logger.info("quantization %s: %d layers stay float32: %s", method, len(kept), kept[:4])
    return prepared
