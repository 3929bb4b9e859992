"""Mamba-2 mixers on the CPU in torch (an all-decode step runs csrc/mamba_decode.cpp where
the kernels are built): the causal conv1d with its carried state, the
chunked selective scan (SSD) for prefill and the one-token recurrence for decode."""
