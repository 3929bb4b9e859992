"""The Mamba-2 mixer (vLLM's MambaMixer2) over the flattened tokens of a step.

Each request's state (conv state + SSM state) lives in its one block of the layer's
Mamba KV cache group: the mixer gathers the batch's states, runs decode rows together
through the one-token recurrence and every other row (a prefill chunk, drafts) through
the chunked scan from its carried state, and writes the states back. A request with no
computed tokens starts from zeros (its block's old content is ignored).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import _custom_ops as ops
from kvserve.forward_context import get_forward_context
from kvserve.model_executor.layers.linear import ReplicatedLinear
from kvserve.model_executor.layers.mamba.causal_conv1d import (
    causal_conv1d_fn,
    causal_conv1d_update,
)
from kvserve.model_executor.layers.mamba.mamba_metadata import MambaMetadata
from kvserve.model_executor.layers.mamba.ssd import selective_state_update, ssd_chunk_scan
from kvserve.model_executor.layers.mamba.state_cache import MambaStateCache, NoStateCache
from kvserve.transformers_utils.mamba_arch import MambaArch


class MambaRMSNormGated(nn.Module):
    """``rmsnorm(y * silu(gate))`` over groups of ``group_size`` channels (HF's
    MambaRMSNormGated, norm after the gate), or ``rmsnorm(y) * silu(gate)`` with
    ``norm_before_gate`` (FalconH1's ``mamba_norm_before_gate``)."""

    def __init__(
        self, hidden_size: int, group_size: int, eps: float, norm_before_gate: bool = False
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.group_size = group_size
        self.eps = eps
        self.norm_before_gate = norm_before_gate

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if not self.norm_before_gate:
            x = x * F.silu(gate.float())
        grouped = x.view(*x.shape[:-1], -1, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = self.weight * grouped.view(x.shape)
        return normed * F.silu(gate.float()) if self.norm_before_gate else normed


class SiluGate(nn.Module):
    """``y * silu(gate)`` without a norm (FalconH1 with ``mamba_rms_norm`` off)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return x * F.silu(gate)


class MambaMixer2(nn.Module):
    def __init__(self, hidden_size: int, mamba: MambaArch, layer_name: str) -> None:
        super().__init__()
        self.mamba = mamba
        self.layer_name = layer_name
        self.num_heads, self.head_dim = mamba.num_heads, mamba.head_dim
        self.n_groups, self.state_size = mamba.n_groups, mamba.state_size
        self.intermediate_size = mamba.intermediate_size
        self.conv_dim = mamba.conv_dim
        self.in_proj = ReplicatedLinear(
            hidden_size,
            self.intermediate_size + self.conv_dim + self.num_heads,
            bias=mamba.use_bias,
            prefix=f"{layer_name}.in_proj",
        )
        # The checkpoint's nn.Conv1d names and shapes: weight [D, 1, K], bias [D].
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, mamba.conv_kernel, groups=self.conv_dim,
            bias=mamba.use_conv_bias,
        )  # fmt: skip
        self.conv1d.requires_grad_(False)
        self.dt_bias = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.ones(self.num_heads), requires_grad=False)
        self.norm: nn.Module = SiluGate()
        if mamba.rms_norm:
            self.norm = MambaRMSNormGated(
                self.intermediate_size, self.intermediate_size // self.n_groups,
                mamba.norm_eps, mamba.norm_before_gate,
            )  # fmt: skip
        self.out_proj = ReplicatedLinear(
            self.intermediate_size,
            hidden_size,
            bias=mamba.use_bias if mamba.out_proj_bias is None else mamba.out_proj_bias,
            prefix=f"{layer_name}.out_proj",
        )
        self.state_cache: MambaStateCache = NoStateCache()

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return self.mamba.conv_state_shape

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return self.mamba.ssm_state_shape

    def bind_state_cache(self, memory: torch.Tensor, num_blocks: int) -> None:
        self.state_cache = MambaStateCache(
            memory, num_blocks, self.conv_state_shape, self.ssm_state_shape
        )

    # ---- the pieces of one row ---------------------------------------------------------

    def _conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight[:, 0, :]

    def _ssm_inputs(
        self, xbc: torch.Tensor, dt: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Activated conv output ``[n, D]`` and raw dt ``[n, H]`` -> x ``[n, H, P]``,
        dt after softplus and the limit, B, C ``[n, G, N]``."""
        n = xbc.shape[0]
        x, B, C = F.silu(xbc).split(
            [
                self.intermediate_size,
                self.n_groups * self.state_size,
                self.n_groups * self.state_size,
            ],
            dim=-1,
        )
        low, high = self.mamba.time_step_limit
        dt = F.softplus(dt + self.dt_bias).clamp(low, high)
        groups = (n, self.n_groups, self.state_size)
        return x.reshape(n, self.num_heads, self.head_dim), dt, B.reshape(groups), C.reshape(groups)

    def _run_sequence(
        self, xbc: torch.Tensor, dt: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One request's tokens from its state -> (y ``[n, H, P]``, conv state, ssm state)."""
        conv_out, conv_state = causal_conv1d_fn(
            xbc, conv_state, self._conv_weight(), self.conv1d.bias
        )
        x, dt, B, C = self._ssm_inputs(conv_out, dt)
        A = -torch.exp(self.A_log)
        y, ssm_state = ssd_chunk_scan(x, dt, A, B, C, self.mamba.chunk_size, ssm_state)
        return y + self.D[:, None] * x, conv_state, ssm_state

    def _step(
        self, xbc: torch.Tensor, dt: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token of each of R requests (the decode recurrence)."""
        conv_out, conv_state = causal_conv1d_update(
            xbc, conv_state, self._conv_weight(), self.conv1d.bias
        )
        x, dt, B, C = self._ssm_inputs(conv_out, dt)
        y, ssm_state = selective_state_update(ssm_state, x, dt, -torch.exp(self.A_log), B, C)
        return y + self.D[:, None] * x, conv_state, ssm_state

    # ---- the step ----------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        gate, xbc, dt = self.in_proj.forward(hidden_states).split(
            [self.intermediate_size, self.conv_dim, self.num_heads], dim=-1
        )
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, dict):
            metadata = metadata[self.layer_name]
        if metadata is None:  # profiling run: the tokens as one fresh sequence
            conv0 = xbc.new_zeros(self.conv_state_shape)
            ssm0 = xbc.new_zeros(self.ssm_state_shape)
            y, _, _ = self._run_sequence(xbc, dt, conv0, ssm0)
        else:
            y = self._forward_batch(metadata, xbc, dt, num_tokens)
        y = self.norm(y.reshape(num_tokens, self.intermediate_size), gate)
        return self.out_proj.forward(y)

    def _forward_batch(
        self, md: MambaMetadata, xbc: torch.Tensor, dt: torch.Tensor, num_tokens: int
    ) -> torch.Tensor:
        if not md.other_rows and md.decode_rows.numel() == num_tokens and ops.use_for(xbc):
            return self._decode_in_pool(md, xbc, dt)
        conv_states, ssm_states = self.state_cache.gather(md.state_block_ids)
        fresh = ~md.has_initial_state
        if bool(fresh.any()):
            conv_states[fresh] = 0.0
            ssm_states[fresh] = 0.0
        y = xbc.new_zeros(num_tokens, self.num_heads, self.head_dim)
        if not md.other_rows and md.decode_rows.numel() == num_tokens:
            # All decode (most steps): no row indexing.
            y_all, conv_states, ssm_states = self._step(xbc, dt, conv_states, ssm_states)
            y = y_all
        elif md.decode_rows.numel():
            rows, tokens = md.decode_rows, md.decode_tokens
            y_rows, conv_new, ssm_new = self._step(
                xbc[tokens], dt[tokens], conv_states[rows], ssm_states[rows]
            )
            y[tokens] = y_rows
            conv_states[rows] = conv_new
            ssm_states[rows] = ssm_new
        starts = md.query_start_loc
        for row in md.other_rows:
            start, end = starts[row], starts[row + 1]
            if row in md.keep_position_states:
                y[start:end] = self._run_keeping_states(
                    md, row, xbc[start:end], dt[start:end], conv_states, ssm_states
                )
                continue
            conv, ssm = conv_states[row], ssm_states[row]
            done = 0
            # Prefix caching: the scan stops at each block end to store that entry.
            for offset, block_id in md.boundaries.get(row, ()):
                piece = slice(start + done, start + offset)
                y[piece], conv, ssm = self._run_sequence(xbc[piece], dt[piece], conv, ssm)
                self.write_state(block_id, conv, ssm)
                done = offset
            rest = slice(start + done, end)
            y[rest], conv_states[row], ssm_states[row] = self._run_sequence(
                xbc[rest], dt[rest], conv, ssm
            )
        self.state_cache.scatter(md.write_block_ids, conv_states, ssm_states)
        return y

    def _decode_in_pool(
        self, md: MambaMetadata, xbc: torch.Tensor, dt: torch.Tensor
    ) -> torch.Tensor:
        """An all-decode step in one kernel call (csrc/mamba_decode.cpp), the states
        read and written in the pool: what ``_step`` between a gather and a scatter
        computes, without their passes over the states."""
        y = xbc.new_empty(xbc.shape[0], self.intermediate_size)
        ops.mamba_decode_step(
            y, xbc, dt, self.state_cache.pages, md.state_block_ids, md.write_block_ids,
            md.has_initial_state, self._conv_weight(), self.conv1d.bias, self.dt_bias,
            -torch.exp(self.A_log), self.D, self.mamba.time_step_limit, self.n_groups,
            self.state_size,
        )  # fmt: skip
        return y

    def _run_keeping_states(
        self,
        md: MambaMetadata,
        row: int,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        conv_states: torch.Tensor,
        ssm_states: torch.Tensor,
    ) -> torch.Tensor:
        """A row with drafts: token by token, keeping the state after each position so
        the runner can put back the one after the accepted tokens."""
        conv, ssm = conv_states[row : row + 1], ssm_states[row : row + 1]
        outputs, convs, ssms = [], [], []
        for i in range(xbc.shape[0]):
            y, conv, ssm = self._step(xbc[i : i + 1], dt[i : i + 1], conv, ssm)
            outputs.append(y)
            convs.append(conv)
            ssms.append(ssm.clone())  # the next _step updates ssm in place
        conv_states[row], ssm_states[row] = conv[0], ssm[0]
        for offset, block_id in md.boundaries.get(row, ()):
            self.write_state(block_id, convs[offset - 1][0], ssms[offset - 1][0])
        md.position_states.setdefault(self.layer_name, {})[row] = (
            torch.cat(convs),
            torch.cat(ssms),
        )
        return torch.cat(outputs)

    def write_state(self, block_id: int, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> None:
        """One state into one block: a block end's entry, or, after drafts were
        rejected, the state after the accepted tokens."""
        ids = torch.tensor([block_id], dtype=torch.int64)
        self.state_cache.scatter(ids, conv_state[None], ssm_state[None])


def get_mamba_layers(model: nn.Module) -> dict[str, MambaMixer2]:
    return {m.layer_name: m for m in model.modules() if isinstance(m, MambaMixer2)}
