"""Multimodal inputs: the items of a prompt that are not text, where they sit in the
token sequence, and the content hashes that key their caches."""

from kvserve.multimodal.hasher import MultiModalHasher
from kvserve.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

__all__ = ["MultiModalFeatureSpec", "MultiModalHasher", "PlaceholderRange"]
