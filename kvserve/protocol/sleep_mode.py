"""Sleep mode's vocabulary (vLLM's): the levels of sleep and the tags wake_up takes,
checked the same way by the server, the front end and the workers."""

from __future__ import annotations

WEIGHTS = "weights"
KV_CACHE = "kv_cache"
SLEEP_TAGS = (WEIGHTS, KV_CACHE)


def check_sleep_level(level: int) -> None:
    if level not in (1, 2):
        raise ValueError(f"level must be 1 (free the KV cache) or 2 (and the weights), got {level}")


def check_wake_tags(tags: list[str] | None) -> list[str]:
    """The tags to wake (every one for None); ValueError for an unknown one."""
    if tags is None:
        return list(SLEEP_TAGS)
    unknown = [tag for tag in tags if tag not in SLEEP_TAGS]
    if unknown:
        raise ValueError(f"tags must be among {list(SLEEP_TAGS)}, got {unknown}")
    return list(tags)
