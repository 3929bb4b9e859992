"""Model code: parallel-aware layers, model definitions, weight loaders."""

from __future__ import annotations
