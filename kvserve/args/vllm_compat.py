"""vLLM's EngineArgs names that a script passes and kvserve has no use for here.

A vLLM script must run unchanged, so these are accepted; none is dropped silently. Each
name has one of three treatments, kept in IGNORED_ARGS:

- "no-op": nothing to do in kvserve (e.g. it never downloads, so ``hf_token`` is moot);
- "GPU-only": a CUDA-side knob (CUDA graphs, swap space, offload) that kvserve's eager
  engine has no counterpart for, on the CPU or on a GPU;
- "default-only": a feature kvserve does not have; its vLLM default (the value that turns
  it off) is accepted and anything else is a ValueError naming the field.

No-op and GPU-only arguments given a value are logged once, at WARNING, when the engine
config is built. The arguments with a meaning here (gpu_memory_utilization, max_logprobs,
generation_config, ...) are EngineArgs' own fields; docs/vllm_compat.md lists them all.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvserve.config.compilation import CompilationConfig

logger = logging.getLogger(__name__)

Treatment = Literal["no-op", "GPU-only", "default-only"]
# The GPU-only names that take effect on a CUDA device (so are logged only on a CPU).
CUDA_GRAPH_ARGS = frozenset(
    {"enforce_eager", "compilation_config", "cuda_graph_sizes", "max_cudagraph_capture_size"}
)


@dataclass(frozen=True)
class IgnoredArg:
    treatment: Treatment
    why: str
    # default-only: the values that mean "off" (None, "not given", is always accepted).
    accepted: tuple[Any, ...] = ()
    # The CLI flag's argparse type; "flag" is a store_true switch, "json" a JSON object.
    cli: type | str = str


IGNORED_ARGS: dict[str, IgnoredArg] = {
    # CUDA graphs: real on a CUDA device (EngineArgs builds the CompilationConfig from
    # them), logged as without effect on a CPU, which always runs eagerly.
    "enforce_eager": IgnoredArg(
        "GPU-only", "CUDA graphs are captured on CUDA only; a CPU runs eagerly", cli="flag"
    ),
    "compilation_config": IgnoredArg(
        "GPU-only",
        "on CUDA its cudagraph_capture_sizes / max_cudagraph_capture_size are read; "
        "no torch.compile",
        cli="json",
    ),
    "cuda_graph_sizes": IgnoredArg(
        "GPU-only", "vLLM's older name of cudagraph_capture_sizes; CUDA only", cli=int
    ),
    "max_cudagraph_capture_size": IgnoredArg(
        "GPU-only", "the largest captured decode batch; CUDA only", cli=int
    ),
    "max_seq_len_to_capture": IgnoredArg("GPU-only", "no CUDA graphs are captured", cli=int),
    "swap_space": IgnoredArg(
        "GPU-only", "preempted requests are recomputed; there is no GPU->CPU swap", cli=float
    ),
    "cpu_offload_gb": IgnoredArg(
        "GPU-only", "weights are not offloaded from a GPU to host memory", cli=float
    ),
    "disable_custom_all_reduce": IgnoredArg(
        "GPU-only", "single-worker engine: no all-reduce kernels", cli="flag"
    ),
    "calculate_kv_scales": IgnoredArg(
        "GPU-only", "fp8 KV cache scales; kvserve's KV dtypes need none", cli="flag"
    ),
    # Loading and download knobs (kvserve never touches the network).
    "trust_remote_code": IgnoredArg(
        "no-op",
        "kvserve runs only its own model code; tokenizers load without remote code",
        cli="flag",
    ),
    "hf_token": IgnoredArg("no-op", "models are local files; nothing is downloaded"),
    "code_revision": IgnoredArg("no-op", "no remote model code is ever loaded"),
    "ignore_patterns": IgnoredArg("no-op", "models are local files; nothing is downloaded"),
    "max_parallel_loading_workers": IgnoredArg("no-op", "one worker loads the model", cli=int),
    "use_tqdm_on_load": IgnoredArg("no-op", "loading shows no progress bar", cli="flag"),
    "pt_load_map_location": IgnoredArg("no-op", "weights load on the engine's device"),
    "model_loader_extra_config": IgnoredArg(
        "no-op", "the loaders take no extra options", cli="json"
    ),
    # Engine-loop knobs with no counterpart.
    "disable_async_output_proc": IgnoredArg(
        "no-op", "outputs are processed in the front end already", cli="flag"
    ),
    "use_v2_block_manager": IgnoredArg("no-op", "deprecated in vLLM too", cli="flag"),
    "prefix_caching_hash_algo": IgnoredArg(
        "no-op", "block hashes use kvserve's seeded hash (prefix_caching_hash_seed)"
    ),
    "show_hidden_metrics_for_version": IgnoredArg("no-op", "no hidden metrics to show"),
    "additional_config": IgnoredArg("no-op", "no platform plug-ins read it", cli="json"),
    "tokenizer_pool_size": IgnoredArg("no-op", "tokenization runs in the front end", cli=int),
    # Features kvserve does not have: accepted only where they are off.
    "num_scheduler_steps": IgnoredArg("default-only", "one step per schedule", (1,), cli=int),
    "tokenizer_mode": IgnoredArg(
        "default-only", "HF tokenizers only (fast where one exists)", ("auto", "hf")
    ),
    "config_format": IgnoredArg("default-only", "HF config.json or GGUF metadata", ("auto", "hf")),
    "model_impl": IgnoredArg("default-only", "kvserve's own model code", ("auto", "vllm")),
    "hf_overrides": IgnoredArg("default-only", "config overrides", ({},), cli="json"),
    "rope_scaling": IgnoredArg(
        "default-only", "RoPE comes from the model's config", ({},), cli="json"
    ),
    "rope_theta": IgnoredArg("default-only", "RoPE comes from the model's config", cli=float),
    "disable_sliding_window": IgnoredArg(
        "default-only", "sliding-window layers keep their window", (False,), cli="flag"
    ),
    "preemption_mode": IgnoredArg("default-only", "preemption recomputes", ("recompute",)),
    "scheduler_cls": IgnoredArg("default-only", "one scheduler class"),
    "worker_cls": IgnoredArg("default-only", "one worker class", ("auto",)),
    "worker_extension_cls": IgnoredArg("default-only", "workers take no extensions", ("",)),
    "logprobs_mode": IgnoredArg(
        "default-only", "logprobs are the model's raw log-softmax", ("raw_logprobs",)
    ),
    "enable_prompt_embeds": IgnoredArg(
        "default-only", "prompts are text or token ids", (False,), cli="flag"
    ),
    "kv_sharing_fast_prefill": IgnoredArg(
        "default-only", "no cross-layer KV sharing", (False,), cli="flag"
    ),
    "otlp_traces_endpoint": IgnoredArg("default-only", "no OpenTelemetry tracing"),
    "collect_detailed_traces": IgnoredArg("default-only", "no OpenTelemetry tracing"),
}


@dataclass(kw_only=True)
class VllmCompatArgs:
    """EngineArgs' base: one field per IGNORED_ARGS name, None when not given."""

    enforce_eager: bool | None = None
    compilation_config: Any = None
    cuda_graph_sizes: Any = None
    max_cudagraph_capture_size: int | None = None
    max_seq_len_to_capture: int | None = None
    swap_space: float | None = None
    cpu_offload_gb: float | None = None
    disable_custom_all_reduce: bool | None = None
    calculate_kv_scales: bool | None = None
    trust_remote_code: bool | None = None
    hf_token: Any = None
    code_revision: str | None = None
    ignore_patterns: Any = None
    max_parallel_loading_workers: int | None = None
    use_tqdm_on_load: bool | None = None
    pt_load_map_location: Any = None
    model_loader_extra_config: Any = None
    disable_async_output_proc: bool | None = None
    use_v2_block_manager: bool | None = None
    prefix_caching_hash_algo: str | None = None
    show_hidden_metrics_for_version: str | None = None
    additional_config: Any = None
    tokenizer_pool_size: int | None = None
    num_scheduler_steps: int | None = None
    tokenizer_mode: str | None = None
    config_format: str | None = None
    model_impl: str | None = None
    hf_overrides: Any = None
    rope_scaling: Any = None
    rope_theta: float | None = None
    disable_sliding_window: bool | None = None
    preemption_mode: str | None = None
    scheduler_cls: Any = None
    worker_cls: Any = None
    worker_extension_cls: Any = None
    logprobs_mode: str | None = None
    enable_prompt_embeds: bool | None = None
    kv_sharing_fast_prefill: bool | None = None
    otlp_traces_endpoint: str | None = None
    collect_detailed_traces: Any = None

    def check_ignored_args(self, device: str = "cpu") -> None:
        """Logs each no-op / GPU-only argument given (the CUDA graph ones only where
        ``device`` is not CUDA); raises for default-only ones set on."""
        used = CUDA_GRAPH_ARGS if device == "cuda" else frozenset()
        check_ignored(self, {k: v for k, v in IGNORED_ARGS.items() if k not in used})

    def cuda_graph_config(self) -> CompilationConfig:
        """The CUDA graph settings from vLLM's arguments: enforce_eager, and the capture
        sizes from compilation_config's keys, cuda_graph_sizes or
        max_cudagraph_capture_size (resolved against the scheduler by EngineConfig)."""
        given = self.compilation_config or {}
        if isinstance(given, str):
            given = json.loads(given)
        if not isinstance(given, dict):
            raise ValueError(f"compilation_config must be a JSON object, got {given!r}")
        sizes = given.get("cudagraph_capture_sizes", self.cuda_graph_sizes)
        if isinstance(sizes, int):
            sizes = [sizes]
        return CompilationConfig(
            cudagraph_capture_sizes=None if sizes is None else list(sizes),
            max_cudagraph_capture_size=given.get(
                "max_cudagraph_capture_size", self.max_cudagraph_capture_size
            ),
            enforce_eager=bool(self.enforce_eager),
        )

    @staticmethod
    def add_ignored_cli_args(parser: argparse.ArgumentParser) -> None:
        add_ignored_cli_args(parser, IGNORED_ARGS)


def check_ignored(values: object, table: Mapping[str, IgnoredArg]) -> None:
    """For each ``table`` name set (not None) on ``values``: logs it, or raises ValueError
    when it is default-only and set to something else than an accepted value."""
    for name, arg in table.items():
        value = getattr(values, name, None)
        if value is None:
            continue
        if arg.treatment == "default-only":
            if value not in arg.accepted:
                accepted = f" or pass {arg.accepted[0]!r}" if arg.accepted else ""
                raise ValueError(
                    f"{name}={value!r} is not supported by kvserve ({arg.why}); "
                    f"leave it unset{accepted}"
                )
            continue
        logger.warning(
            "%s=%r has no effect in kvserve (%s): %s", name, value, arg.treatment, arg.why
        )


def add_ignored_cli_args(
    parser: argparse.ArgumentParser,
    table: Mapping[str, IgnoredArg],
    title: str = "vLLM compatibility",
) -> None:
    """vLLM's flags for ``table``'s names (default None), grouped so --help says what each
    does here."""
    group = parser.add_argument_group(
        title, "accepted so vLLM command lines run; see docs/vllm_compat.md"
    )
    for name, arg in table.items():
        flag = "--" + name.replace("_", "-")
        help_text = f"{arg.treatment}: {arg.why}"
        if arg.cli == "flag":
            group.add_argument(flag, action="store_true", default=None, help=help_text)
        else:
            kind = json.loads if arg.cli == "json" else arg.cli
            group.add_argument(flag, type=kind, default=None, help=help_text)  # type: ignore[arg-type]
