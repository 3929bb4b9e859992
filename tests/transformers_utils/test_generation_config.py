"""load_generation_defaults: HF generation_config.json, GGUF sampling metadata, overrides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.transformers_utils.generation_config import load_generation_defaults
from kvserve.transformers_utils.model_resolver import ResolvedModel


def hf_dir(tmp_path: Path, generation: dict[str, object] | None) -> ResolvedModel:
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return ResolvedModel(str(tmp_path), "hf", str(tmp_path), "tiny")


def test_hf_generation_config_gives_sampling_field_names(tmp_path: Path) -> None:
    resolved = hf_dir(
        tmp_path,
        {"temperature": 0.6, "top_k": 20, "top_p": 0.9, "max_new_tokens": 64,
         "repetition_penalty": 1.1, "eos_token_id": 2, "do_sample": True},
    )  # fmt: skip
    assert load_generation_defaults(resolved, "auto") == {
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.9,
        "max_tokens": 64,
        "repetition_penalty": 1.1,
    }
    assert load_generation_defaults(resolved, "vllm") == {}
    # Overrides (HF key names, as vLLM's override_generation_config) go on top, also on "vllm".
    assert load_generation_defaults(resolved, "vllm", {"temperature": 0.0}) == {"temperature": 0.0}


def test_no_generation_config_means_no_defaults(tmp_path: Path) -> None:
    assert load_generation_defaults(hf_dir(tmp_path, None), "auto") == {}


def test_a_folder_source_and_its_errors(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.5}))
    resolved = hf_dir(tmp_path, {"top_p": 0.9})
    assert load_generation_defaults(resolved, str(other)) == {"top_p": 0.5}
    with pytest.raises(ValueError, match="generation_config must be 'auto', 'vllm' or a folder"):
        load_generation_defaults(resolved, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="override_generation_config: unknown key 'temp'"):
        load_generation_defaults(resolved, "auto", {"temp": 0.1})
    (other / "generation_config.json").write_text(json.dumps({"top_k": "many"}))
    with pytest.raises(ValueError, match="top_k must be a number"):
        load_generation_defaults(resolved, str(other))


def test_gguf_sampling_metadata(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.25)
    writer.add_int32("general.sampling.top_k", 7)
    writer.add_float32("general.sampling.penalty_repeat", 1.5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    resolved = ResolvedModel(str(path), "gguf", str(path), "tiny")
    assert load_generation_defaults(resolved, "auto") == {
        "temperature": 0.25,
        "top_k": 7,
        "repetition_penalty": 1.5,
    }
    assert load_generation_defaults(resolved, "vllm") == {}


def test_bad_defaults_stop_the_engine_config(tmp_path: Path) -> None:
    from kvserve.args.engine_args import EngineArgs
    from tests.entrypoints.test_llm_tiny_models import build_model

    build_model("llama", tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.0}))
    with pytest.raises(ValueError, match=r"generation config of .*top_p must be in \(0, 1\]"):
        EngineArgs(model=str(tmp_path)).create_engine_config()
