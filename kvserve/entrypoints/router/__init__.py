"""Prefix-aware routing over several kvserve instances, learned from their KV events."""
