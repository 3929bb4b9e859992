"""The multimodal engine arguments: CLI flags and keyword arguments become the
MultiModalConfig (and its encoder cache connector config); bad values name their flag."""

from __future__ import annotations

import argparse
import json

import pytest

from kvserve.args.engine_args import EngineArgs
from kvserve.config import ECTransferConfig, MultiModalConfig


def test_cli_flags_make_the_config() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(
        [
            "--limit-mm-per-prompt", json.dumps({"image": 2}),
            "--max-image-pixels", "1000",
            "--mm-processor-kwargs", json.dumps({"do_pan_and_scan": True}),
            "--allowed-local-media-path", "/data/images",
            "--allow-remote-media",
            "--ec-transfer-config", json.dumps({"ec_connector": "disk", "ec_storage_path": "/x"}),
        ]
    )  # fmt: skip
    config = EngineArgs.from_cli_args(args)._multimodal_config()
    assert config.limit_mm_per_prompt == {"image": 2} and config.max_image_pixels == 1000
    assert config.mm_processor_kwargs == {"do_pan_and_scan": True}
    assert config.allowed_local_media_path == "/data/images" and config.allow_remote_media
    assert config.ec_transfer_config == ECTransferConfig("disk", ec_storage_path="/x")
    assert EngineArgs()._multimodal_config() == MultiModalConfig()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"limit_mm_per_prompt": "{"}, "limit_mm_per_prompt is not valid JSON"),
        ({"limit_mm_per_prompt": {"video": 1}}, "unsupported modality 'video'"),
        ({"limit_mm_per_prompt": {"image": -1}}, "needs an int >= 0"),
        ({"max_image_pixels": 0}, "max_image_pixels must be positive"),
        ({"ec_transfer_config": {"ec_connector": "disk"}}, "needs ec_storage_path"),
        ({"ec_transfer_config": {"ec_connector": "redis"}}, "needs ec_redis_url"),
        ({"ec_transfer_config": {"ec_connector": "s3"}}, "unknown ec_connector 's3'"),
        ({"ec_transfer_config": {"path": "/x"}}, "--ec-transfer-config: unknown key"),
    ],
)
def test_bad_values_name_their_flag(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)._multimodal_config()  # type: ignore[arg-type]
