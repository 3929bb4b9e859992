"""Encoder cache transfer between engine instances (vLLM's ec_transfer)."""
