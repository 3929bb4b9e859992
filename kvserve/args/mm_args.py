"""The multimodal engine arguments (vLLM's names where vLLM has them), their CLI flags, and
the MultiModalConfig they make."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from kvserve.config import ECTransferConfig, MultiModalConfig


def _json_object(flag: str, value: dict[str, Any] | str | None) -> dict[str, Any] | None:
    if value is None or isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{flag} must be a JSON object, got {value!r}")
    return parsed


@dataclass
class MultiModalArgs:
    # {"image": N}: most images in one prompt.
    limit_mm_per_prompt: dict[str, int] | str | None = None
    max_image_pixels: int = 16_000_000
    mm_processor_cache_gb: float = 1.0
    mm_processor_kwargs: dict[str, Any] | str | None = None
    encoder_cache_size: int = 0
    allowed_local_media_path: str | None = None
    allow_remote_media: bool = False
    # {"ec_connector": "disk" | "redis", "ec_storage_path" | "ec_redis_url": ...}
    ec_transfer_config: ECTransferConfig | dict[str, Any] | str | None = None

    def _multimodal_config(self) -> MultiModalConfig:
        limits = _json_object("limit_mm_per_prompt", self.limit_mm_per_prompt)
        ec = self.ec_transfer_config
        if ec is not None and not isinstance(ec, ECTransferConfig):
            ec = ECTransferConfig.from_cli(ec)
        return MultiModalConfig(
            limit_mm_per_prompt=limits if limits is not None else {"image": 4},
            max_image_pixels=self.max_image_pixels,
            mm_processor_cache_gb=self.mm_processor_cache_gb,
            mm_processor_kwargs=_json_object("mm_processor_kwargs", self.mm_processor_kwargs),
            encoder_cache_size=self.encoder_cache_size,
            allowed_local_media_path=self.allowed_local_media_path,
            allow_remote_media=self.allow_remote_media,
            ec_transfer_config=ec,
        )


def add_mm_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multimodal input")
    group.add_argument(
        "--limit-mm-per-prompt", default=None, help="JSON, e.g. '{\"image\": 2}' (default 4 images)"
    )
    group.add_argument("--max-image-pixels", type=int, default=16_000_000)
    group.add_argument("--mm-processor-cache-gb", type=float, default=1.0)
    group.add_argument("--mm-processor-kwargs", default=None, help="JSON, e.g. Pan-and-Scan")
    group.add_argument("--encoder-cache-size", type=int, default=0)
    group.add_argument(
        "--allowed-local-media-path", default=None, help="directory file:// image URLs may read"
    )
    group.add_argument("--allow-remote-media", action="store_true", help="fetch http(s) image URLs")
    group.add_argument(
        "--ec-transfer-config",
        default=None,
        help='encoder cache connector, JSON: {"ec_connector": "disk", "ec_storage_path": DIR}',
    )
