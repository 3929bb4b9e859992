"""The engine core: the process (or, offline, the thread) that owns the scheduler, the KV
cache manager and the executor, and steps them. The front end (kvserve/engine/) reaches it
through a client: across processes by messages (protocol/core_messages.py), and in its own
process through the in-process client, the one front-end module that imports this one."""
