"""Re-exports of the multimodal wire structs (defined with the other messages in
``kvserve.protocol`` so every layer may use them)."""

from kvserve.protocol.mm_inputs import MultiModalFeatureSpec, PlaceholderRange, TensorData

__all__ = ["MultiModalFeatureSpec", "PlaceholderRange", "TensorData"]
