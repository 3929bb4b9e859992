"""revision / download_dir pick a local copy; nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.transformers_utils.local_model import locate_model


def cache_repo(root: Path, name: str, commit: str, ref: str = "main") -> Path:
    repo = root / ("models--" + name.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / ref).write_text(commit)
    return snapshot


def test_download_dir_in_the_hf_cache_layout(tmp_path: Path) -> None:
    snapshot = cache_repo(tmp_path, "org/tiny", "abc123", ref="v1")
    assert locate_model("org/tiny", "v1", str(tmp_path)) == str(snapshot)
    assert locate_model("org/tiny", "abc123", str(tmp_path)) == str(snapshot)
    with pytest.raises(ValueError, match="kvserve does not download"):
        locate_model("org/tiny", "v2", str(tmp_path))


def test_download_dir_holding_a_plain_folder(tmp_path: Path) -> None:
    (tmp_path / "tiny").mkdir()
    assert locate_model("tiny", None, str(tmp_path)) == str(tmp_path / "tiny")


def test_local_paths_and_unset_arguments_pass_through(tmp_path: Path) -> None:
    assert locate_model(str(tmp_path), None, "/elsewhere") == str(tmp_path)
    assert locate_model("SmolLM2-135M-Instruct", None, None) == "SmolLM2-135M-Instruct"
