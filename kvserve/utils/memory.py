"""How much memory the machine has free, and vLLM's gpu_memory_utilization accounting:
on CUDA the share of the device's total memory this instance may use, of which the KV
cache gets what the weights, the activation peak, the CUDA graphs' pools and the memory
torch does not manage leave (kv_cache_budget); on a CPU a share of the free host RAM."""

from __future__ import annotations

from dataclasses import dataclass

_GiB = float(1 << 30)


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


def check_utilization(utilization: float) -> None:
    if isinstance(utilization, bool) or not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")


def kv_cache_bytes_for_utilization(utilization: float, device: str) -> int:
    """On the CPU, gpu_memory_utilization as a KV cache size: that share of the host
    memory available now (before the model loads). It plays the part of vLLM's
    VLLM_CPU_KVCACHE_SPACE, which is a size; here the size follows the machine."""
    check_utilization(utilization)
    free, _ = available_memory_bytes(device)
    return int(free * utilization)


def requested_memory(utilization: float, total: int, free_at_start: int) -> int:
    """The bytes this instance may use: ``utilization`` of the device's total. Like vLLM,
    an error at start when other processes already hold more than the rest."""
    check_utilization(utilization)
    requested = int(total * utilization)
    if requested > free_at_start:
        raise ValueError(
            f"gpu_memory_utilization={utilization} asks for {requested / _GiB:.2f} GiB of the "
            f"device's {total / _GiB:.2f} GiB, but only {free_at_start / _GiB:.2f} GiB were "
            "free at start (other processes hold the rest): lower gpu_memory_utilization or "
            "free the device"
        )
    return requested


@dataclass(frozen=True)
class MemoryProfile:
    """One worker's device memory in bytes, measured before its KV cache exists."""

    total: int
    free_at_start: int
    # What torch holds after loading: the weights and the runner's persistent buffers.
    weights: int
    # The profile run's peak above ``weights``: activations of the largest step + logits.
    peak_activations: int
    # The captured decode graphs' pools (estimated before the KV cache is allocated).
    cuda_graphs: int
    # Growth of what torch's allocator does not see (CUDA context parts, cuBLAS, NCCL).
    non_torch: int

    @property
    def non_kv_cache(self) -> int:
        return self.weights + self.peak_activations + self.cuda_graphs + self.non_torch


def kv_cache_budget(utilization: float, profile: MemoryProfile) -> int:
    """vLLM's determine_available_memory: the KV cache gets the requested share of the
    device less everything else this instance uses. ValueError when nothing is left."""
    requested = requested_memory(utilization, profile.total, profile.free_at_start)
    budget = requested - profile.non_kv_cache
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} gives this instance "
            f"{requested / _GiB:.2f} GiB, but the weights ({profile.weights / _GiB:.2f} GiB), "
            f"the activation peak ({profile.peak_activations / _GiB:.2f} GiB), CUDA graphs "
            f"({profile.cuda_graphs / _GiB:.2f} GiB) and non-torch memory "
            f"({profile.non_torch / _GiB:.2f} GiB) take {profile.non_kv_cache / _GiB:.2f} GiB, "
            "leaving nothing for the KV cache: raise gpu_memory_utilization, lower "
            "max_num_batched_tokens or the capture sizes, or give kv_cache_memory"
        )
    return budget


def cuda_graph_estimate(first_bytes: int, marginal_bytes: int, num_sizes: int) -> int:
    """The pool of ``num_sizes`` graphs from two captures into one pool: the largest size
    (``first_bytes``, which the smaller ones reuse) and then the smallest (``marginal_bytes``,
    what one more graph adds), scaled to the other sizes as vLLM's estimate does."""
    if num_sizes <= 0:
        return 0
    return first_bytes + marginal_bytes * (num_sizes - 1)
