"""The Mamba-2 decode kernel (csrc/mamba_decode.cpp) against the mixer's torch decode
step (gather, ``_step``, scatter) on random states in a shared pool: outputs and the
states written back, 1-64 rows, fresh rows, a write block other than the read block
(prefix caching's align mode), and pages whose planes split a state mid-row. Run it
with ``KVSERVE_MARCH=haswell`` too for the AVX2 build."""

from __future__ import annotations

import pytest
import torch

from kvserve import _custom_ops as ops
from kvserve.forward_context import set_forward_context
from kvserve.model_executor.layers.mamba.mamba_metadata import MambaMetadata
from kvserve.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from kvserve.transformers_utils.mamba_arch import MambaArch
from tests.kernel_support import require_kernels

require_kernels()

HIDDEN = 64


def _mixer(n_groups: int, time_step_limit: tuple[float, float]) -> MambaMixer2:
    arch = MambaArch(
        num_heads=8, head_dim=16, state_size=16, n_groups=n_groups, conv_kernel=4,
        intermediate_size=128, chunk_size=8, use_conv_bias=True, use_bias=False,
        norm_eps=1e-5, time_step_limit=time_step_limit,
    )  # fmt: skip
    mixer = MambaMixer2(HIDDEN, arch, "layers.0.mixer")
    with torch.no_grad():
        for param in mixer.parameters():
            param.normal_(0.0, 0.3)
        mixer.A_log.uniform_(-1.0, 1.0)
    return mixer


def _metadata(num_rows: int, generator: torch.Generator, num_blocks: int) -> MambaMetadata:
    blocks = torch.randperm(num_blocks, generator=generator)[: 2 * num_rows]
    reads, writes = blocks[:num_rows], blocks[:num_rows].clone()
    moved = torch.rand(num_rows, generator=generator) < 0.3  # align mode: the next block
    writes[moved] = blocks[num_rows:][moved]
    rows = torch.arange(num_rows)
    return MambaMetadata(
        query_start_loc=list(range(num_rows + 1)),
        state_block_ids=reads,
        write_block_ids=writes,
        has_initial_state=torch.rand(num_rows, generator=generator) < 0.8,
        decode_rows=rows,
        decode_tokens=rows.clone(),
        other_rows=[],
    )


@pytest.mark.parametrize("num_rows", [1, 3, 17, 64])
@pytest.mark.parametrize(
    ("n_groups", "time_step_limit", "plane_floats"),
    [(1, (0.0, float("inf")), 1500), (2, (0.01, 0.5), 4096)],
)
def test_decode_kernel_matches_torch_step(
    num_rows: int, n_groups: int, time_step_limit: tuple[float, float], plane_floats: int
) -> None:
    torch.manual_seed(num_rows)
    generator = torch.Generator().manual_seed(num_rows)
    mixer = _mixer(n_groups, time_step_limit)
    num_blocks = 2 * num_rows + 3
    # [2, blocks, plane]: a state is 2,528 floats; 1,500 per plane splits one of its
    # SSM rows across the planes, 4,096 keeps it in the first.
    pool = torch.randn(2, num_blocks, plane_floats)
    md = _metadata(num_rows, generator, num_blocks)
    hidden = torch.randn(num_rows, HIDDEN)

    results = []
    for use_kernel in (False, True):
        mixer.bind_state_cache(pool.clone(), num_blocks)
        with set_forward_context(md):
            if use_kernel:
                out = mixer.forward(hidden)
            else:
                with ops.disabled():
                    out = mixer.forward(hidden)
        results.append((out, mixer.state_cache.pages.clone()))
    (ref_out, ref_pool), (out, new_pool) = results
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    # Every written state equals the reference, and no other byte of the pool changed
    # (the torch scatter zero-fills a page's tail; only the state's floats are compared).
    state_numel = 3 * mixer.conv_dim + 8 * 16 * 16
    flat_ref = ref_pool.transpose(0, 1).reshape(num_blocks, -1)
    flat_new = new_pool.transpose(0, 1).reshape(num_blocks, -1)
    flat_old = pool.transpose(0, 1).reshape(num_blocks, -1)
    written = md.write_block_ids
    torch.testing.assert_close(
        flat_new[written, :state_numel], flat_ref[written, :state_numel], rtol=1e-4, atol=1e-5
    )
    untouched = torch.ones(num_blocks, dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(flat_new[untouched], flat_old[untouched])
