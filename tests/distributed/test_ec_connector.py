"""The encoder cache connector across engine processes: the first encodes the image and
stores the output (disk directory or a real redis-server); a second process loads it,
never runs the vision tower (counted), and gives the same tokens as HF."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kvcache.conftest import RedisServer, find_redis_server
from tests.multimodal.gemma3_mm_model import build_gemma3_vlm, hf_greedy, random_image


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    directory = tmp_path_factory.mktemp("gemma3_vlm_ec")
    model, processor = build_gemma3_vlm(directory)
    image = random_image(3, 64, 24)
    _, expected = hf_greedy(model, processor, "<bos>Look: <start_of_image> what?", [image], 10)
    return directory, expected


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    binary = find_redis_server()
    if binary is None:
        pytest.skip("no redis-server binary (apt-get install redis-server)")
    server = RedisServer(binary, tmp_path)
    server.start()
    yield server.url
    server.stop()


def _run(model: Path, ec: dict[str, Any]) -> dict[str, Any]:
    spec = json.dumps({"model": str(model), "ec": ec, "seed": 3})
    proc = subprocess.run(
        [sys.executable, "-m", "tests.distributed.ec_engine_run", spec],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return dict(json.loads(lines[-1].removeprefix("RESULT ")))


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_second_process_loads_instead_of_encoding(
    vlm: tuple[Path, list[int]], tier: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    model, expected = vlm
    if tier == "disk":
        ec = {"ec_connector": "disk", "ec_storage_path": str(tmp_path / "ec")}
    else:
        ec = {"ec_connector": "redis", "ec_redis_url": request.getfixturevalue("redis_url")}
    first = _run(model, ec)
    assert first["tokens"] == expected
    assert (first["vision_tower_runs"], first["ec_connector_saves"]) == (1, 1)
    assert first["ec_connector_loads"] == 0
    second = _run(model, ec)
    assert second["tokens"] == expected
    assert second["vision_tower_runs"] == 0  # the vision tower never ran
    assert (second["ec_connector_loads"], second["ec_connector_saves"]) == (1, 0)
