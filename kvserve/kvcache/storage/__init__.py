"""Storage tiers of the KV cache: CPU memory, local disk, Redis, the kvserve cache server."""
