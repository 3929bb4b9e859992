"""Workers and the model runner: the device side of an engine step."""

from __future__ import annotations
