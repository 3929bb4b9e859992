"""LoRA adapters applied inside the model: wrapped projections and the adapter slots."""
