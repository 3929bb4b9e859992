"""Where a Triton kernel can run: CUDA tensors compiled, CPU tensors interpreted.

Triton fixes the mode when it is imported: with ``TRITON_INTERPRET=1`` in the
environment every ``@triton.jit`` function (its standard library's included) runs on
the host, on numpy views of the tensors; without it kernels compile for the GPU and
cannot touch CPU memory. A machine without a GPU runs the kernels interpreted (the test
suite sets the variable there, see tests/conftest.py), so a launch checks the mode first
and explains itself instead of failing inside Triton.
"""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction


def check_launchable(kernel: object, tensor: torch.Tensor) -> None:
    if tensor.device.type == "cuda" or isinstance(kernel, InterpretedFunction):
        return
    raise RuntimeError(
        f"Triton kernels run on {tensor.device.type} tensors only under Triton's "
        "interpreter: start the process with TRITON_INTERPRET=1 (read when triton is "
        "first imported), or use another attention backend"
    )
