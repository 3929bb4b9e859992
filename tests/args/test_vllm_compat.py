"""vLLM's engine arguments: meaningful ones change the config, the rest are logged or refused."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
from pathlib import Path

import pytest

from kvserve.args.engine_args import EngineArgs
from kvserve.args.vllm_compat import IGNORED_ARGS, VllmCompatArgs
from kvserve.config import CacheConfig, ParallelConfig
from kvserve.engine.input_processor import InputProcessor
from kvserve.sampling_params import SamplingParams
from kvserve.utils.memory import available_memory_bytes

DOCS = Path(__file__).resolve().parents[2] / "docs" / "vllm_compat.md"


def parse(argv: list[str]) -> EngineArgs:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    return EngineArgs.from_cli_args(parser.parse_args(argv))


def test_every_ignored_name_is_a_field_and_in_the_docs_table() -> None:
    assert {f.name for f in dataclasses.fields(VllmCompatArgs)} == set(IGNORED_ARGS)
    documented = set(re.findall(r"^\| `([a-z0-9_]+)` \|", DOCS.read_text(), re.M))
    missing = {f.name for f in dataclasses.fields(EngineArgs)} - documented
    assert not missing, f"docs/vllm_compat.md lacks {sorted(missing)}"


def test_no_op_arguments_are_logged_by_name(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvserve.args.vllm_compat"):
        EngineArgs(
            enforce_eager=True, swap_space=4, cpu_offload_gb=2, compilation_config={"level": 3}
        ).create_engine_config()
    text = caplog.text
    for name in ("enforce_eager=True", "swap_space=4", "cpu_offload_gb=2", "compilation_config"):
        assert name in text
    assert text.count("GPU-only") == 4
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvserve.args.vllm_compat"):
        EngineArgs().create_engine_config()
    assert not caplog.text, "arguments left unset are not logged"


def test_default_only_arguments_refuse_what_kvserve_lacks() -> None:
    EngineArgs(num_scheduler_steps=1, tokenizer_mode="auto").create_engine_config()
    with pytest.raises(ValueError, match=r"num_scheduler_steps=4 is not supported"):
        EngineArgs(num_scheduler_steps=4).create_engine_config()
    with pytest.raises(ValueError, match=r"rope_scaling"):
        EngineArgs(rope_scaling={"rope_type": "dynamic", "factor": 2.0}).create_engine_config()


def test_unknown_arguments_are_still_errors() -> None:
    with pytest.raises(ValueError, match="unknown engine argument"):
        EngineArgs.from_kwargs(enforce_eagre=True)


def test_gpu_memory_utilization_sizes_the_kv_cache() -> None:
    available, _ = available_memory_bytes("cpu")
    config = EngineArgs(gpu_memory_utilization=0.01, device="cpu").create_engine_config()
    assert config.cache_config.kv_cache_memory == pytest.approx(available * 0.01, rel=0.2)
    # An explicit size wins; neither given: the default size.
    config = EngineArgs(gpu_memory_utilization=0.5, kv_cache_memory="64M").create_engine_config()
    assert config.cache_config.kv_cache_memory == 64 << 20
    config = EngineArgs(kv_cache_memory_bytes=32 << 20).create_engine_config()
    assert config.cache_config.kv_cache_memory == 32 << 20
    assert EngineArgs().create_engine_config().cache_config.kv_cache_memory == (
        CacheConfig.kv_cache_memory
    )
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineArgs(gpu_memory_utilization=1.5).create_engine_config()
    assert config.cache_config.gpu_memory_utilization is None  # the CPU's share is a size


def test_gpu_memory_utilization_on_cuda_is_left_to_the_workers_profile() -> None:
    """On CUDA the share is of the device's total and the worker profiles what it leaves
    (worker/gpu_memory_profiler.py): the config carries the share, not a size."""
    config = EngineArgs(gpu_memory_utilization=0.9, device="cuda").create_engine_config()
    assert config.cache_config.gpu_memory_utilization == 0.9
    config = EngineArgs(
        gpu_memory_utilization=0.9, kv_cache_memory="64M", device="cuda"
    ).create_engine_config()
    assert config.cache_config.gpu_memory_utilization is None
    assert config.cache_config.kv_cache_memory == 64 << 20
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineArgs(gpu_memory_utilization=0.0, device="cuda").create_engine_config()


def test_max_logprobs_is_enforced() -> None:
    config = EngineArgs(max_logprobs=2).create_engine_config()
    processor = InputProcessor(config.model_config, tokenizer=None)
    prompt = {"prompt_token_ids": [1, 2, 3]}
    processor.process_inputs("ok", prompt, SamplingParams(logprobs=2))  # type: ignore[arg-type]
    for params in (SamplingParams(logprobs=3), SamplingParams(prompt_logprobs=-1)):
        with pytest.raises(ValueError, match="max_logprobs=2"):
            processor.process_inputs("r", prompt, params)  # type: ignore[arg-type]


def test_load_format_must_match_the_model() -> None:
    EngineArgs(load_format="gguf").create_engine_config()
    with pytest.raises(ValueError, match="pickles"):
        EngineArgs(load_format="pt").create_engine_config()
    with pytest.raises(ValueError, match="is a GGUF file"):
        EngineArgs(load_format="safetensors").create_engine_config()


def test_cli_flags_with_vllm_names() -> None:
    args = parse(
        ["--enforce-eager", "--swap-space", "4", "--gpu-memory-utilization", "0.01",
         "--max-logprobs", "5", "--generation-config", "vllm", "--trust-remote-code",
         "--disable-log-stats", "--compilation-config", '{"level": 0}',
         "--num-gpu-blocks-override", "64", "--override-generation-config",
         '{"temperature": 0.5}'],
    )  # fmt: skip
    assert args.enforce_eager is True and args.swap_space == 4.0
    assert args.compilation_config == {"level": 0}
    assert (args.max_logprobs, args.generation_config, args.disable_log_stats) == (5, "vllm", True)
    config = args.create_engine_config()
    assert config.model_config.max_logprobs == 5
    assert config.cache_config.num_blocks_override == 64
    assert config.model_config.get_diff_sampling_param() == {"temperature": 0.5}


def test_every_engine_argument_is_a_flag() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    dests = {action.dest for action in parser._actions}
    # vLLM's second names for two fields share their flags (--kv-cache-memory-bytes,
    # --num-gpu-blocks-override).
    aliases = {"kv_cache_memory_bytes", "num_gpu_blocks_override"}
    assert {f.name for f in dataclasses.fields(EngineArgs)} - dests == aliases
    args = parse(["-tp", "1", "--dtype", "auto", "--kv-cache-memory-bytes", "32M"])
    assert args.tensor_parallel_size == 1 and args.kv_cache_memory == "32M"
    # The batch queue is on unless turned off (it matters with -pp only).
    assert args.batch_queue is True
    assert parse(["-pp", "2", "--no-batch-queue"]).batch_queue is False
    with pytest.raises(ValueError, match="batch_queue must be a bool"):
        ParallelConfig(batch_queue="off")  # type: ignore[arg-type]


def test_download_dir_and_revision_pick_a_cached_snapshot(tmp_path: Path) -> None:
    from tests.entrypoints.test_llm_tiny_models import build_model

    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "c0ffee"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c0ffee")
    build_model("llama", snapshot)
    config = EngineArgs(model="org/tiny", download_dir=str(tmp_path)).create_engine_config()
    assert config.model_config.resolved.path == str(snapshot.resolve())
    assert config.model_config.served_model_name == "org/tiny"
    config = EngineArgs(
        model="org/tiny", download_dir=str(tmp_path), revision="c0ffee"
    ).create_engine_config()
    assert config.model_config.resolved.path == str(snapshot.resolve())
    with pytest.raises(ValueError, match="does not download"):
        EngineArgs(
            model="org/tiny", download_dir=str(tmp_path), revision="v9"
        ).create_engine_config()
