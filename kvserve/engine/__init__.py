"""The front end: what runs in the caller's process (the API server's, or the offline
LLM's): input processing, output processing and detokenization, and the clients that
reach the engine core (kvserve/engine_core/). It imports no torch (.importlinter)."""
