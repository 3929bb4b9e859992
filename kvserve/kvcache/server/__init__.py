"""The KV cache server (`kvserve cache-server`) and its wire protocol."""
