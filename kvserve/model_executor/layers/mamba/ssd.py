"""Mamba-2's selective state space model (state space duality, SSD) for one sequence
chunked, and its one-token recurrence for a batch.

Per head h: ``state_t = exp(dt_t A_h) state_{t-1} + dt_t x_t B_t^T`` and
``y_t = state_t C_t`` (plus ``D x_t``, which the mixer adds). The chunked form computes
the same: inside a chunk of Q tokens the output is a masked (Q x Q) product, across
chunks the state is carried by a short recurrence over chunk ends, starting from the
state the sequence had before these tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _heads(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[..., G, N]`` per group -> ``[..., H, N]`` per head (heads of a group share)."""
    groups = t.shape[-2]
    return t.repeat_interleave(num_heads // groups, dim=-2)


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, H, P]``, ``dt [T, H]`` (after softplus), ``A [H]`` (negative), ``B``, ``C``
    ``[T, G, N]``, ``initial_state [H, P, N]`` -> (``y [T, H, P]`` without the D skip,
    the state after the last token ``[H, P, N]``)."""
    num_tokens, num_heads, _ = x.shape
    B, C = _heads(B, num_heads), _heads(C, num_heads)
    pad = (-num_tokens) % chunk_size
    if pad:  # dt = 0 on padding: it neither decays nor feeds the state
        x, dt, B, C = (F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) for t in (x, dt, B, C))
    num_chunks = x.shape[0] // chunk_size
    xc = (x * dt[..., None]).view(num_chunks, chunk_size, num_heads, -1)  # [c, l, h, p]
    Bc = B.view(num_chunks, chunk_size, num_heads, -1)
    Cc = C.view(num_chunks, chunk_size, num_heads, -1)
    dA = (dt * A).view(num_chunks, chunk_size, num_heads).permute(0, 2, 1)  # [c, h, l]
    dA_cumsum = torch.cumsum(dA, dim=-1)
    # Decay from position s to l inside a chunk (l >= s), zero above the diagonal.
    segsum = dA_cumsum[..., :, None] - dA_cumsum[..., None, :]  # [c, h, l, s]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp(segsum.masked_fill(~causal, -torch.inf))
    scores = torch.einsum("clhn,cshn->chls", Cc, Bc) * decay
    y = torch.einsum("chls,cshp->clhp", scores, xc)
    # Each chunk's contribution to the state at its end, then the carry across chunks.
    decay_to_end = torch.exp(dA_cumsum[..., -1:] - dA_cumsum)  # [c, h, l]
    chunk_states = torch.einsum("clhn,chl,clhp->chpn", Bc, decay_to_end, xc)
    chunk_decay = torch.exp(dA_cumsum[..., -1])  # [c, h]
    state = initial_state
    starts = []
    for c in range(num_chunks):
        starts.append(state)
        state = chunk_decay[c][:, None, None] * state + chunk_states[c]
    start_states = torch.stack(starts)  # [c, h, p, n]: the state before each chunk
    y = y + torch.einsum("clhn,chpn,chl->clhp", Cc, start_states, torch.exp(dA_cumsum))
    return y.reshape(-1, num_heads, x.shape[-1])[:num_tokens], state


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of R sequences: ``state [R, H, P, N]`` (updated in place), ``x [R, H, P]``,
    ``dt [R, H]``, ``B``, ``C`` ``[R, G, N]`` -> (``y [R, H, P]`` without the D skip, the
    new state)."""
    num_heads = x.shape[1]
    B, C = _heads(B, num_heads), _heads(C, num_heads)
    dA = torch.exp(dt * A)[..., None, None]  # [R, H, 1, 1]
    # In place: the caller's state is its own copy (MambaStateCache.gather), and a
    # decode step is bound by passes over the state.
    new_state = state.mul_(dA).add_((dt[..., None] * x)[..., None] * B[:, :, None, :])
    y = torch.matmul(new_state, C[..., None])[..., 0]
    return y, new_state
