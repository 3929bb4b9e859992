"""Weights on a CUDA GPU: GGUF blocks dequantized once to float32, then cast to the
engine's dtype (bfloat16 by default). Skipped, with the reason named, without CUDA."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip(
        "needs a CUDA device (weights loaded to bfloat16/float16 on the GPU)",
        allow_module_level=True,
    )

from kvserve.args.engine_args import EngineArgs
from kvserve.model_executor.model_loader import get_model
from kvserve.model_executor.model_loader.gguf_loader import iterate_gguf_weights


@pytest.mark.parametrize(("dtype", "torch_dtype"), [("auto", torch.bfloat16),
                                                    ("float16", torch.float16),
                                                    ("float32", torch.float32)])  # fmt: skip
def test_gguf_weights_are_the_float32_weights_cast(dtype: str, torch_dtype: torch.dtype) -> None:
    config = EngineArgs(device="cuda", dtype=dtype, max_model_len=256).create_engine_config()
    mc = config.model_config
    assert mc.dtype == str(torch_dtype).removeprefix("torch.")
    model = get_model(mc.resolved, mc.arch, "cuda", torch_dtype, None)
    params = dict(model.named_parameters())
    assert all(p.device.type == "cuda" and p.dtype == torch_dtype for p in params.values())
    # Unfused weights keep their checkpoint name: each is the float32 dequantization, cast.
    checked = 0
    for name, weight in iterate_gguf_weights(mc.resolved.path, mc.arch):
        if name in params and params[name].shape == weight.shape:  # unpadded, unfused
            assert torch.equal(params[name].cpu(), weight.to(torch_dtype)), name
            checked += 1
    assert checked > 0
