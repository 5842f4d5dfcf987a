"""The Mamba-1 mixer over the shared pool: in_proj -> conv1d -> x_proj -> dt_proj -> selective scan | state
update, gated by silu(z) -> out_proj.

Decodes come first in the packed batch (one token each, state update by page id);
prefill chunks follow (varlen conv and selective scan, starting from the cached state
when a prompt is resumed).
"""

from __future__ import annotations

import torch
from torch import nn

from runtime import kernels
from runtime.context import get_forward_context
from runtime.layers.norm import RMSNorm


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight, in float32, cast back (HF's FalconMamba order of operations)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class DtProjection(nn.Module):
    """dt_proj as HF stores it (weight and bias), applied without its bias: as in HF, the bias is added
    in float32 inside the scan, where it arrives as dt_bias."""

    def __init__(self, dt_rank: int, d_inner: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_inner, dt_rank))
        self.bias = nn.Parameter(torch.empty(d_inner))

    def forward(self, dt: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(dt, self.weight)


class Mamba1Mixer(nn.Module):
    """Implements runtime.cache.protocol.StateCacheLayer (conv state, then SSM state)."""

    def __init__(
        self,
        layer_idx: int,
        *,
        hidden_size: int,
        d_inner: int,
        d_state: int,
        d_conv: int,
        dt_rank: int,
        conv_bias: bool,
        proj_bias: bool,
        dt_bc_norm_eps: float | None = None,
        dt_bc_norm_weights: bool = True,
    ):
        """dt_bc_norm_eps: Jamba RMS-normalises dt, B and C after x_proj with this eps; None (Mamba) does not.
        dt_bc_norm_weights=False: those norms have no weights (FalconMamba)."""
        super().__init__()
        self.layer_idx = layer_idx
        self.d_inner, self.d_state, self.d_conv, self.dt_rank = d_inner, d_state, d_conv, dt_rank
        self.in_proj = nn.Linear(hidden_size, 2 * d_inner, bias=proj_bias)
        # Holds the depthwise weights under HF's name; the kernels apply them.
        self.conv1d = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, bias=conv_bias)
        self.x_proj = nn.Linear(d_inner, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = DtProjection(dt_rank, d_inner)
        self.A_log = nn.Parameter(torch.zeros(d_inner, d_state))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, hidden_size, bias=proj_bias)
        self.has_dt_bc_norms = dt_bc_norm_eps is not None
        self.dt_bc_norm_eps = dt_bc_norm_eps
        self.dt_bc_norm_weights = dt_bc_norm_weights
        if self.has_dt_bc_norms and dt_bc_norm_weights:
            self.dt_layernorm = RMSNorm(dt_rank, dt_bc_norm_eps)
            self.b_layernorm = RMSNorm(d_state, dt_bc_norm_eps)
            self.c_layernorm = RMSNorm(d_state, dt_bc_norm_eps)
        self.group = -1  # state group, set when the pool is bound
        self.conv_states: torch.Tensor | None = None  # (num_pages, d_conv - 1, d_inner) view
        self.ssm_states: torch.Tensor | None = None  # (num_pages, d_inner, d_state) view

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return (self.d_conv - 1, self.d_inner), (self.d_inner, self.d_state)

    def bind(self, group: int, conv_states: torch.Tensor, ssm_states: torch.Tensor) -> None:
        self.group, self.conv_states, self.ssm_states = group, conv_states, ssm_states

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (T, hidden_size) -> (T, hidden_size)."""
        x, z = self.in_proj(hidden).chunk(2, dim=-1)
        x = self._conv(x)
        dt, B, C = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        if self.has_dt_bc_norms and self.dt_bc_norm_weights:
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        elif self.has_dt_bc_norms:
            dt, B, C = (rms_normalize(t, self.dt_bc_norm_eps) for t in (dt, B, C))
        dt = self.dt_proj(dt)
        return self.out_proj(self._ssm(x, dt, B, C, z))

    def _conv(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        nd, weight, bias = ctx.num_decodes, self.conv1d.weight.squeeze(1), self.conv1d.bias
        out = torch.empty_like(x)
        if nd:
            pages, waves = ctx.decode_pages(self.group)
            out[:nd] = kernels.causal_conv1d_update(x[:nd], weight, bias, self.conv_states, pages, waves=waves)
        if ctx.num_prefill_tokens:
            out[nd:] = kernels.causal_conv1d_fn(
                x[nd:], weight, bias, self.conv_states, ctx.prefill_state_indices[self.group], ctx.mamba_prefill
            )
        return out

    def _ssm(self, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             z: torch.Tensor) -> torch.Tensor:
        """x, dt, z: (T, d_inner); B, C: (T, d_state) -> gated scan output (T, d_inner)."""
        ctx = get_forward_context()
        nd = ctx.num_decodes
        A = -torch.exp(self.A_log.float())
        dt_bias = self.dt_proj.bias.float()
        y = torch.empty_like(x)
        if nd:
            pages, waves = ctx.decode_pages(self.group)
            kernels.selective_state_update_mamba1(self.ssm_states, x[:nd], dt[:nd], A, B[:nd], C[:nd], self.D,
                                                  dt_bias, z[:nd], pages, y[:nd], waves=waves)
        if ctx.num_prefill_tokens:
            kernels.selective_scan(
                x[nd:], dt[nd:], A, B[nd:], C[nd:], self.D, dt_bias, z[nd:], self.ssm_states,
                ctx.prefill_state_indices[self.group], ctx.mamba_prefill, y[nd:],
            )
        return y
