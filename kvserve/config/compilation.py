"""CUDA graphs for decode steps: vLLM's names and defaults (CompilationConfig's
``cudagraph_capture_sizes`` and ``max_cudagraph_capture_size``, ModelConfig's
``enforce_eager``). Resolved against the scheduler's budgets; the worker captures one
graph per size (worker/cuda_graph_runner.py) when the device is CUDA."""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's default ceiling: larger decode batches run eagerly (their launch overhead is a
# small share of the step by then).
DEFAULT_MAX_CUDAGRAPH_CAPTURE_SIZE = 512


def default_capture_sizes(max_size: int) -> list[int]:
    """vLLM's default list: 1, 2, 4, multiples of 8 below 256, then multiples of 16 up to
    ``max_size`` (every size at most ``max_size``)."""
    sizes = [s for s in (1, 2, 4) if s <= max_size]
    sizes += range(8, min(max_size + 1, 256), 8)
    sizes += range(256, max_size + 1, 16)
    return sizes


@dataclass
class CompilationConfig:
    # Decode batch sizes (tokens) with a captured graph; None: default_capture_sizes.
    cudagraph_capture_sizes: list[int] | None = None
    # The largest captured size; None: min(512, max_num_seqs, max_num_batched_tokens).
    max_cudagraph_capture_size: int | None = None
    # vLLM's --enforce-eager: capture nothing, every step runs eagerly.
    enforce_eager: bool = False

    def resolve(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        """Fix both fields from the scheduler's budgets: a decode step holds at most
        max_num_seqs tokens (one per request), so a larger graph would never replay."""
        limit = min(max_num_seqs, max_num_batched_tokens)
        given_max = self.max_cudagraph_capture_size
        if given_max is not None and given_max < 0:
            raise ValueError(f"max_cudagraph_capture_size must be >= 0, got {given_max}")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None:
            if any(not isinstance(s, int) or s < 1 for s in sizes):
                raise ValueError(f"cudagraph_capture_sizes must be positive ints, got {sizes}")
            sizes = sorted(set(sizes))
            if given_max is not None and sizes and given_max != sizes[-1]:
                raise ValueError(
                    f"max_cudagraph_capture_size={given_max} must equal the largest of "
                    f"cudagraph_capture_sizes ({sizes[-1]}) when both are given"
                )
            sizes = [s for s in sizes if s <= limit]
        else:
            ceiling = DEFAULT_MAX_CUDAGRAPH_CAPTURE_SIZE if given_max is None else given_max
            sizes = default_capture_sizes(min(ceiling, limit))
        if self.enforce_eager:
            sizes = []
        self.cudagraph_capture_sizes = sizes
        self.max_cudagraph_capture_size = sizes[-1] if sizes else 0
