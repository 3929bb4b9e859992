"""KV transfer: connectors that load KV from, and save KV to, places outside the engine.

A connector has two halves built from the same class: the scheduler side (in the engine
core, no tensors) decides what to load and save each step and sends its plan to the
worker side as KVConnectorMetadata; the worker side moves the KV, layer by layer.
"""

from __future__ import annotations

from kvserve.distributed.kv_transfer.kv_connector.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from kvserve.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

__all__ = [
    "KVConnectorBase_V1",
    "KVConnectorFactory",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorRole",
]
