"""KV cache events and KV transfer (connector) settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from kvserve.config.json_args import dataclass_from_json


@dataclass(frozen=True)
class KVEventsConfig:
    """Publishing KV cache events (BlockStored / BlockRemoved / AllBlocksCleared)."""

    enable_kv_cache_events: bool = False
    # None: "zmq" when events are enabled, else "null".
    publisher: Literal["null", "zmq"] | None = None
    # The PUB socket binds here; subscribers connect. A "*" port binds any free port.
    # Loopback unless configured: the events carry the prompts' token ids.
    endpoint: str = "tcp://127.0.0.1:5557"
    # ROUTER socket answering replay requests from the ring buffer; None: no replay.
    replay_endpoint: str | None = None
    # Batches (one per engine step with events) kept for replay.
    buffer_steps: int = 10_000
    # ZMQ send high-water mark of the PUB socket: messages beyond it are dropped by ZMQ.
    hwm: int = 100_000
    # Batches waiting for the publisher thread; beyond it publish() drops (never blocks).
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("null", "zmq"):
            raise ValueError(f"kv events publisher must be 'null' or 'zmq', got {self.publisher!r}")
        if not self.endpoint:
            raise ValueError("kv events endpoint must not be empty")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv events {name} must be at least 1, got {getattr(self, name)}")

    @classmethod
    def from_cli(cls, value: KVEventsConfig | dict[str, Any] | str) -> KVEventsConfig:
        """A config from itself, a dict, or the JSON text of `--kv-events-config`."""
        if isinstance(value, KVEventsConfig):
            return value
        return dataclass_from_json(cls, value, "--kv-events-config")


@dataclass(frozen=True)
class KVSecurityConfig:
    """Authentication of KV that leaves the engine (kvserve.kvcache.integrity): the file
    holding the MAC secret (else the environment variable KVSERVE_KV_SECRET), and the
    operator's opt-out that lets stores other hosts can write run without one."""

    kv_secret_file: str | None = None
    allow_unauthenticated_kv: bool = False


_KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass
class KVTransferConfig:
    """A KV connector: which one, its role, and what to do when loading external KV fails.

    Set from Python (``LLM(kv_transfer_config=...)``) or as the JSON object of
    ``--kv-transfer-config``; both go through ``from_cli``.
    """

    # A registered name (e.g. "SharedStorageConnector") or a class in kv_connector_module_path.
    kv_connector: str | None = None
    # "kv_producer" saves KV, "kv_consumer" loads it, "kv_both" does both.
    kv_role: str = "kv_both"
    # Identifies this engine to its peers; a random id when unset.
    engine_id: str | None = None
    # Connector-specific settings, e.g. {"shared_storage_path": "/tmp/kv"}.
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    # Module that defines kv_connector when it is not a built-in one.
    kv_connector_module_path: str | None = None
    # "recompute" rolls the request back to its first bad block; "fail" ends it with an error.
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"

    def __post_init__(self) -> None:
        if self.kv_connector is not None and (
            not isinstance(self.kv_connector, str) or not self.kv_connector
        ):
            raise ValueError(f"kv_connector must be a non-empty string, got {self.kv_connector!r}")
        # vLLM's names; the short forms are accepted too.
        role = self.kv_role if self.kv_role in _KV_ROLES else f"kv_{self.kv_role}"
        if role not in _KV_ROLES:
            raise ValueError(
                f"kv_role must be one of {', '.join(_KV_ROLES)} (or producer/consumer/both), "
                f"got {self.kv_role!r}"
            )
        self.kv_role = role
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError(
                "kv_load_failure_policy must be 'recompute' or 'fail', "
                f"got {self.kv_load_failure_policy!r}"
            )
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError(
                "kv_connector_extra_config must be a dict, "
                f"got {type(self.kv_connector_extra_config).__name__}"
            )
        if self.kv_connector_module_path is not None and not self.kv_connector_module_path:
            raise ValueError("kv_connector_module_path must not be empty")
        if self.engine_id is None:
            import uuid

            self.engine_id = uuid.uuid4().hex

    @property
    def is_kv_transfer_instance(self) -> bool:
        return self.kv_connector is not None

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)

    @classmethod
    def from_cli(cls, value: KVTransferConfig | dict[str, Any] | str) -> KVTransferConfig:
        """A config from itself, a dict, or the JSON text of `--kv-transfer-config`."""
        if isinstance(value, KVTransferConfig):
            return value
        return dataclass_from_json(cls, value, "--kv-transfer-config")
