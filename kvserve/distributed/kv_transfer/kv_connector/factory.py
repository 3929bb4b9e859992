"""KVConnectorFactory: connector name -> class, imported only when asked for."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, ClassVar

from kvserve.distributed.kv_transfer.kv_connector.base import KVConnectorBase_V1, KVConnectorRole

if TYPE_CHECKING:
    from kvserve.config import EngineConfig, KVTransferConfig
    from kvserve.protocol.kv_cache_interface import KVCacheConfig


class KVConnectorFactory:
    # name -> (module path, class name). Lazy so that an unused connector's dependencies
    # (torch, safetensors, sockets) never load in the scheduler.
    _registry: ClassVar[dict[str, tuple[str, str]]] = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        if name in cls._registry:
            raise ValueError(f"KV connector {name!r} is already registered")
        cls._registry[name] = (module_path, class_name)

    @classmethod
    def registered_names(cls) -> list[str]:
        return sorted(cls._registry)

    @classmethod
    def get_connector_class(cls, config: KVTransferConfig) -> type[KVConnectorBase_V1]:
        """The class named by kv_connector: from kv_connector_module_path when set (a user
        connector), else from the registry."""
        name = config.kv_connector
        if name is None:
            raise ValueError("kv_transfer_config.kv_connector is not set")
        if config.kv_connector_module_path:
            module_path, class_name = config.kv_connector_module_path, name
        elif name in cls._registry:
            module_path, class_name = cls._registry[name]
        else:
            raise ValueError(
                f"unknown KV connector {name!r}: registered are "
                f"{', '.join(cls.registered_names())}; set kv_connector_module_path to load "
                "a connector class from your own module"
            )
        try:
            module = importlib.import_module(module_path)
        except ImportError as exc:
            raise ValueError(
                f"cannot import module {module_path!r} for KV connector {name!r}: {exc}"
            ) from exc
        connector_cls = getattr(module, class_name, None)
        if connector_cls is None:
            raise ValueError(f"module {module_path!r} has no KV connector class {class_name!r}")
        if not (isinstance(connector_cls, type) and issubclass(connector_cls, KVConnectorBase_V1)):
            raise ValueError(f"{module_path}.{class_name} is not a KVConnectorBase_V1 subclass")
        return connector_cls

    @classmethod
    def create_connector(
        cls,
        config: EngineConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> KVConnectorBase_V1:
        transfer = config.kv_transfer_config
        if transfer is None or not transfer.is_kv_transfer_instance:
            raise ValueError("create_connector needs a kv_transfer_config with kv_connector set")
        connector_cls = cls.get_connector_class(transfer)
        connector_cls.check_parallel_config(config)
        return connector_cls(config, role, kv_cache_config)

    @classmethod
    def check_parallel_config(cls, config: EngineConfig) -> None:
        """Raises ValueError, before any worker starts, when the configured connector
        cannot run with config's tensor / pipeline parallelism."""
        transfer = config.kv_transfer_config
        if transfer is not None and transfer.is_kv_transfer_instance:
            cls.get_connector_class(transfer).check_parallel_config(config)


_CONNECTORS = "kvserve.distributed.kv_transfer.kv_connector.connectors"
KVConnectorFactory.register_connector(
    "SharedStorageConnector", f"{_CONNECTORS}.shared_storage", "SharedStorageConnector"
)
KVConnectorFactory.register_connector("MultiConnector", f"{_CONNECTORS}.multi", "MultiConnector")
KVConnectorFactory.register_connector(
    "TieredCacheConnector", f"{_CONNECTORS}.tiered_cache", "TieredCacheConnector"
)
KVConnectorFactory.register_connector(
    "P2pZmqConnector", f"{_CONNECTORS}.p2p_zmq", "P2pZmqConnector"
)
