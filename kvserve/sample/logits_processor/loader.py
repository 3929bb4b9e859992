"""Custom logits processors named by the user: classes, or "package.module:Class" strings.

vLLM v1 takes the same `logits_processors` engine argument; a processor is activated per
request by whatever it reads from `SamplingParams.extra_args` in `update_state`.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from kvserve.sample.logits_processor.interface import LogitsProcessor

# A class, or the import path of one: "pkg.mod:Class" (or vLLM's "pkg.mod.Class").
LogitsProcessorSpec = str | type


def load_logits_processor(spec: LogitsProcessorSpec) -> type[LogitsProcessor]:
    """The class `spec` names; ValueError (naming logits_processors) if it is not one."""
    cls: object = spec
    if isinstance(spec, str):
        module_name, sep, qualname = spec.partition(":")
        if not sep:
            module_name, _, qualname = spec.rpartition(".")
        if not module_name or not qualname:
            raise ValueError(
                f"logits_processors: {spec!r} is not 'package.module:Class' (or "
                "'package.module.Class')"
            )
        try:
            cls = importlib.import_module(module_name)
            for part in qualname.split("."):
                cls = getattr(cls, part)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"logits_processors: cannot load {spec!r}: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
        raise ValueError(
            f"logits_processors: {spec!r} is not a subclass of "
            "kvserve.sample.logits_processor.LogitsProcessor"
        )
    return cls


def load_logits_processors(
    specs: Sequence[LogitsProcessorSpec],
) -> tuple[type[LogitsProcessor], ...]:
    return tuple(load_logits_processor(spec) for spec in specs)
