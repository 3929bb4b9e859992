"""Which models a server answers for: the positional model, each ``--model`` and every
model in ``--models-dir``, each under its served name."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from kvserve.args.engine_args import EngineArgs
from kvserve.transformers_utils.model_resolver import DEFAULT_MODEL, resolve_model


@dataclasses.dataclass(frozen=True)
class ModelSource:
    name: str
    engine_args: EngineArgs


def add_multi_model_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("several models (docs/multi_model.md)")
    group.add_argument(
        "--model",
        dest="models",
        action="append",
        default=None,
        metavar="MODEL",
        help="another model to serve (repeatable, after the positional one); each is "
        "named by its file or directory stem and routed by the request's `model` field",
    )
    group.add_argument(
        "--models-dir",
        default=None,
        help="serve every GGUF file and HF model directory (config.json) in this folder",
    )
    group.add_argument(
        "--max-loaded-models",
        type=_positive_int,
        default=None,
        help="engines loaded at once; a request for another model unloads the least "
        "recently used once its requests have finished (default: all)",
    )
    return parser


def model_sources(args: argparse.Namespace) -> list[ModelSource]:
    """The served models in order (the first is loaded at start and is the default);
    ValueError for a folder without models, a duplicate name, or --served-model-name
    given for several models."""
    positional: str | None = getattr(args, "model_path", None)
    paths = ([positional] if positional else []) + list(getattr(args, "models", None) or [])
    models_dir = getattr(args, "models_dir", None)
    if models_dir is not None:
        paths += _discover(Path(models_dir))
    engine_args = EngineArgs.from_cli_args(args)
    if not paths:
        paths = [engine_args.model or DEFAULT_MODEL]
    if len(paths) == 1:
        # One model keeps its usual name: --served-model-name, else the model's own.
        name = engine_args.served_model_name or resolve_model(paths[0]).name
        return [ModelSource(name, dataclasses.replace(engine_args, model=paths[0]))]
    if engine_args.served_model_name is not None:
        raise ValueError(
            "--served-model-name names a single model; with several, each is named by "
            "its file or directory stem"
        )
    sources: dict[str, ModelSource] = {}
    for path in paths:
        name = resolve_model(path).name
        if name in sources:
            raise ValueError(f"two models are named {name!r}: rename one of their files")
        replaced = dataclasses.replace(engine_args, model=path, served_model_name=name)
        sources[name] = ModelSource(name, replaced)
    return list(sources.values())


def _discover(folder: Path) -> list[str]:
    if not folder.is_dir():
        raise ValueError(f"--models-dir {str(folder)!r} is not a directory")
    found = [
        str(entry)
        for entry in sorted(folder.iterdir())
        if (entry.is_file() and entry.suffix == ".gguf") or (entry / "config.json").is_file()
    ]
    if not found:
        raise ValueError(f"--models-dir {str(folder)!r} holds no .gguf file or model directory")
    return found


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {number}")
    return number
