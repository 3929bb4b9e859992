"""Functions that tests run inside worker processes through collective_rpc, by object or
by their ``module:function`` path (workers import this module themselves)."""

from __future__ import annotations

import os
import time

import torch

from kvserve.distributed.parallel_state import get_tp_group
from kvserve.worker.worker import Worker


def whoami(worker: Worker) -> tuple[int, int, int]:
    """(rank, TP group size, pid) of the worker that runs it."""
    return worker.rank, get_tp_group().world_size, os.getpid()


def scaled(worker: Worker, values: list[int], scale: float = 1.0) -> list[float]:
    return [v * scale + worker.rank for v in values]


def nap(worker: Worker, seconds: float) -> int:
    time.sleep(seconds)
    return worker.rank


def block_shapes(worker: Worker) -> dict[str, list[object]]:
    """Layer 0's projections and the LM head: [block weight shape, GGUF type] on this
    rank, plus its attention's [query heads, KV heads]."""
    model = worker.model_runner.model
    layer = model.model.layers[0]
    modules = {
        "qkv_proj": layer.self_attn.qkv_proj,
        "o_proj": layer.self_attn.o_proj,
        "gate_up_proj": layer.mlp.gate_up_proj,
        "down_proj": layer.mlp.down_proj,
        "lm_head": model.lm_head,
    }
    out: dict[str, list[object]] = {}
    for name, module in modules.items():
        bw = module.quant_weight
        out[name] = [bw.shape, bw.qtype.name] if bw is not None else [None, "float32"]
    out["heads"] = [layer.self_attn.attn.num_heads, layer.self_attn.attn.num_kv_heads]
    return out


def embedding_lookup(worker: Worker, token_ids: list[int]) -> dict[str, object]:
    """The input embedding's rows of ``token_ids`` (the all-reduced lookup), the elements of
    its float32 weight and whether it looks rows up in the LM head's blocks, on this rank."""
    model = worker.model_runner.model
    embed = model.model.embed_tokens
    rows = embed.forward(torch.tensor(token_ids, device=worker.device))
    return {
        "rows": rows.cpu().tolist(),
        "weight_numel": embed.weight.numel(),
        "head_blocks": embed.row_blocks is not None
        and embed.row_blocks is model.lm_head.quant_weight,
        "blocks_shape": list(embed.row_blocks.shape) if embed.row_blocks is not None else None,
    }


def own_layers(worker: Worker) -> list[int]:
    """Indices of the decoder layers this rank holds attention caches for."""
    caches = worker.model_runner.kv_caches
    return sorted({int(name.split(".layers.")[1].split(".")[0]) for name in caches})


def tier_shard(worker: Worker) -> tuple[int, int, int]:
    """(worker_id, KV heads of a stored chunk, pinned lookups) of this rank's tiered-cache
    CacheEngine."""
    connector = worker.model_runner.kv_connector
    engine = connector.engine  # type: ignore[union-attr]
    heads = connector._kv_caches[0][0].shape[3]  # type: ignore[union-attr]
    return engine.metadata.worker_id, heads, engine.num_pinned_lookups()


def p2p_rank_transfers(worker: Worker) -> dict[str, int]:
    """This rank's P2pZmqConnector view: transfers it copied in and transfers that failed
    here (each rank receives its own KV heads)."""
    connector = worker.model_runner.kv_connector
    return dict(connector.rank_transfers)  # type: ignore[union-attr]


def own_kv_layers(worker: Worker) -> int:
    """How many attention layers' caches this rank holds (its pipeline stage's)."""
    return len(worker.model_runner.kv_caches)
