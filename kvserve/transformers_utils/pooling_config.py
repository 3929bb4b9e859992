"""Which runner a model gets (generate or pooling) and its pooler's defaults.

sentence-transformers checkpoints say how they pool in ``modules.json`` and the pooling
module's ``config.json`` (``pooling_mode_cls_token`` ...); kvserve reads that where it
exists, as vLLM does, so an embedding model gives the vectors its authors meant.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvserve.pooling_params import PoolerConfig
from kvserve.transformers_utils.arch_config import ArchConfig
from kvserve.transformers_utils.model_resolver import ResolvedModel

RUNNERS = ("auto", "generate", "pooling")
# vLLM's task names -> runner ("generate" keeps sampling; the others pool).
TASK_RUNNERS = {"generate": "generate", "embed": "pooling", "encode": "pooling"}
# sentence-transformers < 6 writes one flag per mode; 6 writes "pooling_mode": "mean".
_ST_POOLING_FLAGS = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
}
_ST_POOLING_MODES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}


def resolve_runner(
    runner: str,
    task: str | None,
    pooler_config: PoolerConfig | None,
    resolved: ResolvedModel,
    arch: ArchConfig,
) -> tuple[str, PoolerConfig | None]:
    """(runner, pooler config); raises ValueError naming the field for a bad combination."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
    if task is not None:
        if task not in TASK_RUNNERS:
            raise ValueError(f"task must be one of {tuple(TASK_RUNNERS)}, got {task!r}")
        task_runner = TASK_RUNNERS[task]
        if runner not in ("auto", task_runner):
            raise ValueError(f"task {task!r} needs runner {task_runner!r}, not {runner!r}")
        runner = task_runner
    if runner == "auto":
        runner = "pooling" if arch.is_encoder_only else "generate"
    if runner == "generate":
        if arch.is_encoder_only:
            raise ValueError(f"{arch.architecture} is an encoder: it needs runner='pooling'")
        return runner, None
    config = pooler_config or PoolerConfig()
    if config.pooling_type is None:
        config = PoolerConfig(
            pooling_type=_sentence_transformers_pooling(resolved)
            or ("CLS" if arch.is_encoder_only else "LAST"),
            normalize=config.normalize,
        )
    return runner, config


def _sentence_transformers_pooling(resolved: ResolvedModel) -> str | None:
    model_dir = Path(resolved.path)
    modules_file = model_dir / "modules.json"
    if resolved.format == "gguf" or not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
        for module in modules:
            if module.get("type", "").endswith("Pooling"):
                config = json.loads((model_dir / module["path"] / "config.json").read_text())
                mode = config.get("pooling_mode")
                if isinstance(mode, str):
                    if mode not in _ST_POOLING_MODES:
                        raise ValueError(f"pooling_mode {mode!r} is not supported")
                    return _ST_POOLING_MODES[mode]
                for key, pooling_type in _ST_POOLING_FLAGS.items():
                    if config.get(key):
                        return pooling_type
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(
            f"cannot read the sentence-transformers pooling of {model_dir}: {e}"
        ) from None
    return None
