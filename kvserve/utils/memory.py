"""How much memory the machine has free, for gpu_memory_utilization's KV cache share."""

from __future__ import annotations


def available_memory_bytes(device: str) -> tuple[int, int]:
    """(available, total) bytes of ``device``: the GPU's, or host RAM's MemAvailable."""
    if device == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info()
        return int(free), int(total)
    fields: dict[str, int] = {}
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            fields[key] = int(rest.split()[0]) * 1024
    return fields["MemAvailable"], fields["MemTotal"]


def kv_cache_bytes_for_utilization(utilization: float, device: str) -> int:
    """vLLM's gpu_memory_utilization as a KV cache size: that share of the device's memory
    available now (before the model loads). On the CPU it plays the part of vLLM's
    VLLM_CPU_KVCACHE_SPACE, which is a size; here the size follows the machine."""
    if isinstance(utilization, bool) or not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    free, _ = available_memory_bytes(device)
    return int(free * utilization)
