"""Distributed pieces: parallel groups, KV transfer connectors and KV cache events."""

from __future__ import annotations
