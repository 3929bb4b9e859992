"""Building blocks shared by the model definitions."""

from __future__ import annotations
