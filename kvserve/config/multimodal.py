"""Multimodal inputs and the encoder cache connector."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from kvserve.config.json_args import dataclass_from_json
from kvserve.config.model import GiB


@dataclass
class ECTransferConfig:
    """The encoder cache connector (vLLM's ECConnector): encoder outputs stored to and
    loaded from a tier shared between engine instances. ``ec_connector``: "disk" (a
    directory, ``ec_storage_path``) or "redis" (``ec_redis_url``)."""

    ec_connector: Literal["disk", "redis"]
    ec_storage_path: str | None = None
    ec_redis_url: str | None = None

    def __post_init__(self) -> None:
        if self.ec_connector == "disk" and not self.ec_storage_path:
            raise ValueError("ec_transfer_config: the disk connector needs ec_storage_path")
        if self.ec_connector == "redis" and not self.ec_redis_url:
            raise ValueError("ec_transfer_config: the redis connector needs ec_redis_url")
        if self.ec_connector not in ("disk", "redis"):
            raise ValueError(
                f"ec_transfer_config: unknown ec_connector {self.ec_connector!r} (disk, redis)"
            )

    @classmethod
    def from_cli(cls, value: dict[str, Any] | str) -> ECTransferConfig:
        return dataclass_from_json(cls, value, "--ec-transfer-config")


@dataclass
class MultiModalConfig:
    """Multimodal input (vLLM's names). ``limit_mm_per_prompt``: most items per modality
    in one prompt; ``max_image_pixels``: the largest image (width x height) accepted;
    ``mm_processor_cache_gb``: the processor cache (front end and its core mirror);
    ``encoder_cache_size``: embedding tokens the encoder cache holds (0: the larger of
    max_num_batched_tokens and the longest item); ``allowed_local_media_path``: the
    directory ``file://`` image URLs may read; ``allow_remote_media``: fetch http(s)."""

    limit_mm_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": 4})
    max_image_pixels: int = 16_000_000
    mm_processor_cache_gb: float = 1.0
    mm_processor_kwargs: dict[str, Any] | None = None
    encoder_cache_size: int = 0
    allowed_local_media_path: str | None = None
    allow_remote_media: bool = False
    ec_transfer_config: ECTransferConfig | None = None

    def __post_init__(self) -> None:
        for modality, limit in self.limit_mm_per_prompt.items():
            if modality != "image":
                raise ValueError(f"limit_mm_per_prompt: unsupported modality {modality!r}")
            if not isinstance(limit, int) or limit < 0:
                raise ValueError(f"limit_mm_per_prompt: {modality} needs an int >= 0")
        if self.max_image_pixels <= 0:
            raise ValueError("max_image_pixels must be positive")
        if self.mm_processor_cache_gb < 0:
            raise ValueError("mm_processor_cache_gb must be >= 0")

    @property
    def processor_cache_bytes(self) -> int:
        return int(self.mm_processor_cache_gb * GiB)
